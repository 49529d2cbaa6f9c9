#!/usr/bin/env bash
# The SmolLM2 rows of experiments/results/h200/smollm2.json (issue 26), on one H200: jaxinfer's
# engine (smollm2_h200.yaml) against transformers `generate` on the same GGUF, 128/128, at batch 64
# and batch 1, each with engine.decode_steps 8 and 1. One process per run; JAX's persistent
# compilation cache lets the batch-1 runs reuse the batch-64 runs' executables.
#   bash experiments/vs_transformers/smollm2_h200.sh OUT_DIR [RUN ...]   (default: all four runs)
set -euo pipefail
out=${1:?usage: smollm2_h200.sh OUT_DIR [RUN ...]}
shift
runs=("${@:-b64_ds8 b1_ds8 b64_ds1 b1_ds1}")
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxinfer_jax_cache}
run() {  # name, requests, transformers batch size, decode steps
  [[ " ${runs[*]} " == *" $1 "* ]] || return 0
  PYTHONUNBUFFERED=1 python3 experiments/vs_transformers/run.py --config experiments/vs_transformers/smollm2_h200.yaml \
    --num-requests "$2" --prompt-lo 128 --prompt-hi 128 --output-len 128 --hf-batch-sizes "$3" \
    --set engine.decode_steps="$4" --out "$out/smollm2_$1.json"
}
run b64_ds8 64 64 8
run b1_ds8 1 1 8
run b64_ds1 64 64 1
run b1_ds1 1 1 1
