"""A/B driver: bench_e2e.py with the RMSNorm computed up front (not deferred into the projections).

PYTHONPATH=. python3 experiments/scratch/ab_no_deferred_norm.py <bench_e2e.py arguments>
"""

import runpy
import sys
from pathlib import Path

import jaxinfer.models.dense as dense
from jaxinfer.models.layers import rms_norm

# decoder_layer looks the name up at call time; a None row scale leaves the projections as is
dense.deferred_rms_norm = lambda x, w, eps: (rms_norm(x, w, eps), None)
sys.argv = ["bench_e2e.py", *sys.argv[1:]]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench_e2e.py"), run_name="__main__")
