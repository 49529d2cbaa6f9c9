"""experiments/batch_invariance/perplexity.py: on `tiny` (CPU, fp32) its default-numerics
score through the paged forward is the dense forward's held-out loss (the same windows and
targets), and the batch-invariant score is the same model's (perplexity within rounding, every
argmax agreeing but near-ties)."""

from __future__ import annotations

import json

import experiment_scripts
import numpy as np

from jaxinfer.engine.loading import load_model
from jaxinfer.train.evaluate import heldout_windows
from jaxinfer.train.trainer import heldout_loss


def test_perplexity_with_and_without_the_switch_on_tiny(tmp_path):
    script = experiment_scripts.load("batch_invariance/perplexity")
    out = tmp_path / "ppl.json"
    args = ["--out", str(out), "--models", "tiny", "--max-windows", "4", "--seq-len", "48",
            "--windows-per-step", "2"]  # fmt: skip
    script.main(args)
    result = json.loads(out.read_text())
    assert {"device", "jax", "commit", "date", "command"} <= set(result)
    assert result["dtype"] == "float32" and "batch_invariant=True" in result["numerics"]
    (row,) = result["rows"]
    assert row["windows"] == 4 and row["tokens_scored"] == 4 * 48
    # the reference: the dense forward's mean loss over the same windows
    cfg, params, tokenizer = load_model("tiny", dtype="float32")
    windows, _, _ = heldout_windows(tokenizer, "code", 48, 2, 4)
    dense = heldout_loss(params, cfg, windows, 2)
    np.testing.assert_allclose(row["default"]["nats_per_token"], dense, rtol=1e-5)
    np.testing.assert_allclose(row["batch_invariant"]["nats_per_token"], dense, rtol=1e-5)
    assert row["max_abs_logprob_change"] < 1e-3 and row["argmax_agreement"] > 0.99, row
