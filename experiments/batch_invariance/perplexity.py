"""Does `engine.batch_invariant` change what the model computes? Held-out perplexity through the
paged forward (`forward_paged`, the engine's step) with default and with batch-invariant
numerics, the same windows, one process (issue 48: "perplexity unchanged").

    python experiments/batch_invariance/perplexity.py --out /tmp/bi_ppl.json          # CPU, fp32
    python3 experiments/batch_invariance/perplexity.py --out $OUT/batch_invariance_perplexity.json

Per model (`tiny` on held-out stdlib code, `smollm2` on held-out English: the windows
`heldout_perplexity` and `experiments/quant_quality` score), each numerics scores every window
as one prefill of `--seq-len` tokens, `--windows-per-step` windows a step: perplexity, and
between the two the perplexity change, the largest and mean |change| of a token's log-prob,
and the fraction of positions whose argmax agrees. The invariant numerics are the engine's
(`resolve_numerics`: the XLA forms on a CPU, the invariant GEMM kernel on a GPU); attention is
the XLA backend's on both (its invariant form on the invariant side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxinfer.engine.config import EngineConfig  # noqa: E402
from jaxinfer.engine.loading import load_model  # noqa: E402
from jaxinfer.engine.model_runner import resolve_numerics  # noqa: E402
from jaxinfer.kv.cache import init_kv_cache  # noqa: E402
from jaxinfer.models.batch import build_ragged_batch  # noqa: E402
from jaxinfer.models.dense import compute_logits, forward_paged  # noqa: E402
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics, log_softmax  # noqa: E402
from jaxinfer.provenance import provenance  # noqa: E402
from jaxinfer.train.evaluate import heldout_windows  # noqa: E402

MODEL_TEXT = {"tiny": "code", "smollm2": "english"}
PAGE_SIZE = 16


@partial(jax.jit, static_argnames=("cfg", "numerics"))
def _token_logprobs(params, batch, kv, targets, *, cfg, numerics: Numerics):
    """(log-prob of each target [T], argmax [T]) of one prefill step over a ragged batch."""
    hidden, _ = forward_paged(params, cfg, batch, kv, numerics=numerics)
    logp = log_softmax(compute_logits(params, cfg, hidden, numerics), numerics)
    picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return picked, jnp.argmax(logp, axis=-1).astype(jnp.int32)


def score(cfg, params, windows: np.ndarray, per_step: int, numerics: Numerics):
    """(log-probs [n, L], argmaxes [n, L]) of windows [n, L + 1] (each window's tokens 0..L-1
    predicting 1..L), `per_step` windows a prefill step."""
    n, length = windows.shape[0], windows.shape[1] - 1
    pages_per_seq = -(-length // PAGE_SIZE)
    kv = init_kv_cache(cfg, per_step * pages_per_seq + 1, PAGE_SIZE)
    pages = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))
             for i in range(per_step)]  # fmt: skip
    logps, argmaxes = [], []
    for i in range(0, n, per_step):
        chunk = windows[i : i + per_step]
        batch = build_ragged_batch([w[:-1].tolist() for w in chunk], [0] * len(chunk),
                                   pages[: len(chunk)], num_tokens=per_step * length,
                                   num_seqs=per_step, pages_per_seq=pages_per_seq)  # fmt: skip
        targets = np.zeros(per_step * length, np.int32)
        targets[: chunk.size - len(chunk)] = chunk[:, 1:].reshape(-1)
        lp, am = _token_logprobs(params, batch, kv, jnp.asarray(targets), cfg=cfg,
                                 numerics=numerics)  # fmt: skip
        rows = len(chunk) * length
        logps.append(np.asarray(lp)[:rows].reshape(len(chunk), length))
        argmaxes.append(np.asarray(am)[:rows].reshape(len(chunk), length))
    return np.concatenate(logps), np.concatenate(argmaxes)


def compare(model: str, args, invariant: Numerics) -> dict:
    t0 = time.perf_counter()
    cfg, params, tokenizer = load_model(model, dtype=args.dtype)
    windows, _, _ = heldout_windows(tokenizer, MODEL_TEXT[model], args.seq_len,
                                    args.windows_per_step, args.max_windows)  # fmt: skip
    row = {"model": model, "text": MODEL_TEXT[model], "windows": len(windows),
           "tokens_scored": int(windows[:, 1:].size)}  # fmt: skip
    results = {}
    for name, numerics in (("default", DEFAULT_NUMERICS), ("batch_invariant", invariant)):
        t1 = time.perf_counter()
        lp, am = score(cfg, params, windows, args.windows_per_step, numerics)
        nll = -float(np.mean(lp.astype(np.float64)))
        results[name] = (lp, am)
        row[name] = {"perplexity": float(np.exp(nll)), "nats_per_token": nll,
                     "seconds": round(time.perf_counter() - t1, 1)}  # fmt: skip
    (lp0, am0), (lp1, am1) = results["default"], results["batch_invariant"]
    diff = np.abs(lp1.astype(np.float64) - lp0)
    row["ppl_change_pct"] = 100 * (row["batch_invariant"]["perplexity"]
                                   / row["default"]["perplexity"] - 1)  # fmt: skip
    row["max_abs_logprob_change"] = float(diff.max())
    row["mean_abs_logprob_change"] = float(diff.mean())
    row["argmax_agreement"] = float(np.mean(am0 == am1))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--models", nargs="+", default=list(MODEL_TEXT), choices=list(MODEL_TEXT))
    ap.add_argument("--max-windows", type=int, default=32, help="held-out windows scored")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows-per-step", type=int, default=4)
    ap.add_argument("--dtype", default=None,
                    help="default bfloat16 on a GPU, float32 on a CPU (XLA:CPU's bf16 "
                         "matmuls are slow)")  # fmt: skip
    args = ap.parse_args(argv)
    platform = jax.devices()[0].platform
    args.dtype = args.dtype or ("bfloat16" if platform == "gpu" else "float32")
    invariant = resolve_numerics(EngineConfig(model="preset:tiny", batch_invariant=True))
    result = {**provenance(), "dtype": args.dtype, "numerics": repr(invariant),
              "settings": {k: getattr(args, k) for k in ("max_windows", "seq_len",
                                                         "windows_per_step")},
              "rows": []}  # fmt: skip
    for model in args.models:  # (written after each model: an interrupted run keeps its rows)
        result["rows"].append(compare(model, args, invariant))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        r = result["rows"][-1]
        print(f"{model}: perplexity {r['default']['perplexity']:.4f} default, "
              f"{r['batch_invariant']['perplexity']:.4f} invariant ({r['ppl_change_pct']:+.4f}%); "
              f"max |d logprob| {r['max_abs_logprob_change']:.2e}, "
              f"argmax agreement {r['argmax_agreement']:.4f}", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    main()
