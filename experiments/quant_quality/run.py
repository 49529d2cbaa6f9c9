"""Quality of every weight format against the plain model: held-out perplexity, KL divergence of
the next-token distributions, and greedy-token agreement, side by side with the seeds' claims.

    python experiments/quant_quality/run.py --models tiny \
        --out experiments/results/cpu/quant_quality.json --plot experiments/results/cpu/quant_quality.png
    python3 experiments/quant_quality/run.py \
        --out experiments/results/h200/quant_quality.json --plot experiments/results/h200/quant_quality.png

Each model (`smollm2` on English, `tiny` on code) is loaded once in --dtype; that plain model is
the reference, and each format is `jaxinfer.quant.transform.quantize` of its params (round to
nearest; `fp8_static` also calibrated, see `calibration_windows`). Per (model, format) row:
- perplexity over the held-out windows `heldout_perplexity` scores (`heldout_windows`: the first
  --max-windows non-overlapping windows of --seq-len tokens), and its change against the reference;
- mean KL(ref || quant) over the same predicted tokens, fp32 log-softmax of both logits;
- greedy agreement: the reference's greedy continuation (--gen-tokens) of --num-prompts prompts
  (the first --prompt-tokens tokens of held-out windows spread over the stream), generated once
  through the paged KV cache, is teacher-forced through each model in one batch; the reference
  token of a position is the reference's own argmax in that same teacher-forced pass (so the
  reference row agrees 1.0 by construction, and a near-tie that paged and dense attention round
  differently is counted in `reference.generated_vs_teacher_forced_mismatches`, not against a
  format). Reported: the fraction of positions whose argmax is the reference token (mean over
  prompts) and the mean position of each prompt's first disagreement (--gen-tokens if none).

A format changes the param pytree, so each compiles its own program: one per format (`_score`: a
scan over the window batches, all of one shape, and the greedy pass), plus its quantizers and
`_weight_sums`. The reference's logits of the windows are computed once and kept on the device
(at most `REF_CACHE_BYTES`). The JSON is rewritten after every row; a format that fails records
its error and the run goes on.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.assets import model_path
from jaxinfer.checkpoint.gguf_io import is_gguf, open_gguf
from jaxinfer.engine.loading import load_model
from jaxinfer.generate import greedy_generate
from jaxinfer.models.dense import forward
from jaxinfer.provenance import provenance
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from jaxinfer.quant.transform import quantize
from jaxinfer.train.corpus import stdlib_corpus
from jaxinfer.train.data import encode_stream, eval_windows
from jaxinfer.train.evaluate import heldout_windows

MODEL_TEXT = {"smollm2": "english", "tiny": "code"}
FORMATS = ("none", *WEIGHT_FORMATS)  # "none": the reference itself
REF_CACHE_BYTES = 8 << 30  # smollm2's 64 default windows: 3 GiB
DTYPE_NOTE = ("default bfloat16 on GPU, float32 on CPU: bfloat16 matmuls in XLA:CPU are "
              "extremely slow, so a CPU run's reference is the float32 model")  # fmt: skip
SMOLLM2_NOTE = (
    "smollm2's plain weights are dequantized from its GGUF file (gguf_tensor_types): every "
    "format re-quantizes weights that are already 4-bit. q4_1 takes the file's own blocks of 32 "
    "inputs, so its round to nearest finds the stored quants again and can differ only by the "
    "float16 rounding of each block's scale and min, and in bfloat16 by the plain weights' own "
    "rounding of the GGUF values (weight_exact_fraction counts the dequantized weights equal to "
    "the plain ones in the run's dtype)"
)

# The seeds' quality-loss claims per precision (no metric named; we compare the perplexity change).
SEED_004, SEED_002 = "004_29059313fb147d8d.txt", "002_3b3c35b6b617889b.txt"
FP8 = ("fp8_tensor", "fp8_channel", "fp8_block", "fp8_static")
INT8 = ("int8", "q8_0")
INT4 = ("int4_g128_sym", "int4_g128_asym")
CLAIMS = (
    dict(seed=SEED_004, precision="INT8", claim="<1%", range_pct=(None, 1.0), formats=INT8),
    dict(seed=SEED_004, precision="FP8", claim="<1%", range_pct=(None, 1.0), formats=FP8),
    dict(seed=SEED_004, precision="INT4 (GPTQ/AWQ)", claim="1-3%", range_pct=(1.0, 3.0),
         formats=(*INT4, "q4_1")),
    dict(seed=SEED_004, precision="FP4 (NVFP4)", claim="2-5%", range_pct=(2.0, 5.0),
         formats=("nvfp4", "mxfp4")),
    dict(seed=SEED_002, precision="INT8 / FP8", claim="<0.5% quality loss",
         range_pct=(None, 0.5), formats=(*FP8, *INT8)),
    dict(seed=SEED_002, precision="INT4 (GPTQ/AWQ)", claim="~1–3% quality loss",
         range_pct=(1.0, 3.0), formats=INT4),
)  # fmt: skip


def claim_verdicts(fmt: str, change_pct: float) -> list[dict]:
    """Each seed claim covering `fmt`, with whether `change_pct` is inside its range ("below":
    less loss than claimed, "above": more)."""
    out = []
    for c in CLAIMS:
        if fmt not in c["formats"]:
            continue
        lo, hi = c["range_pct"]
        verdict = "inside"
        if change_pct > hi:
            verdict = "above"
        elif lo is not None and change_pct < lo:
            verdict = "below"
        out.append({k: c[k] for k in ("seed", "precision", "claim", "range_pct")}
                   | {"verdict": verdict, "inside": verdict == "inside"})  # fmt: skip
    return out


@functools.partial(jax.jit, static_argnames="cfg")
def _window_logits(params, windows, *, cfg):
    """fp32 logits [nb, B, L, V] of windows [nb, B, L + 1] (the reference's, kept)."""
    return jax.lax.map(lambda w: forward(params, cfg, w[:, :-1]), windows)


@functools.partial(jax.jit, static_argnames=("cfg", "start"))
def _score(params, windows, ref_logits, forced, *, cfg, start: int):
    """One program per format (its params' pytree): per batch of windows [nb, B, L + 1] the
    sums of -log q(target), of KL(ref || q) (fp32 log-softmax of both) and the count of argmax
    agreements, [nb, 3]; and the argmax [P, L' - start] of teacher-forced tokens `forced`
    [P, L'] from position `start` on."""

    def batch(_, xs):
        w, ref = xs
        logq = jax.nn.log_softmax(forward(params, cfg, w[:, :-1]).astype(jnp.float32), axis=-1)
        logp = jax.nn.log_softmax(ref.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logq, w[:, 1:, None], axis=-1).sum()
        kl = (jnp.exp(logp) * (logp - logq)).sum()
        top1 = (jnp.argmax(logq, -1) == jnp.argmax(logp, -1)).sum()
        return None, jnp.stack([nll, kl, top1.astype(jnp.float32)])

    _, sums = jax.lax.scan(batch, None, (windows, ref_logits))
    greedy = jnp.argmax(forward(params, cfg, forced)[:, start:], axis=-1).astype(jnp.int32)
    return sums, greedy


def calibration_windows(tokenizer, text: str, rows: int, seq_len: int,
                        heldout_fraction: float) -> tuple[np.ndarray, dict]:  # fmt: skip
    """[rows, seq_len] tokens that no held-out window contains, for fp8_static's activation
    scales: the corpus's train-split files (code), or their module docstrings (English), in
    sorted file order, as one stream (EOS between texts) cut into rows."""
    corpus = stdlib_corpus(heldout_fraction=heldout_fraction)
    need, parts, files = rows * seq_len, [], 0
    for f in corpus.train:
        source = (corpus.root / f).read_text(encoding="utf-8", errors="replace")
        if text == "english":
            try:
                source = ast.get_docstring(ast.parse(source))
            except (SyntaxError, ValueError):
                source = None
            if not source:
                continue
        parts.append(encode_stream(tokenizer, [source]))
        files += 1
        if sum(map(len, parts)) >= need:
            break
    stream = np.concatenate(parts)
    if len(stream) < need:
        raise ValueError(f"the train split has {len(stream)} calibration tokens, need {need}")
    what = "files" if text == "code" else "module docstrings of files"
    source = f"the stdlib corpus's train split ({what}, disjoint from the held-out files)"
    return stream[:need].reshape(rows, seq_len), {
        "source": source, "files": files, "tokens": need, "shape": [rows, seq_len],
        "first_file": corpus.train[0].as_posix(),
    }  # fmt: skip


@jax.jit
def _weight_sums(qlayers, layers):
    """Over the quantized weights of the layers: sum (dequantized - plain)^2, sum plain^2, the
    count of dequantized elements equal to the plain ones in their dtype, and of all elements."""
    sums = jnp.zeros(4, jnp.float32)
    for ql, pl in zip(qlayers, layers, strict=True):
        for name, qw in ql.items():
            if isinstance(qw, QuantizedWeight):
                w, deq = pl[name], qw.format.dequantize(qw)
                err = deq.astype(jnp.float32) - w.astype(jnp.float32)
                sums += jnp.stack([jnp.sum(err**2), jnp.sum(w.astype(jnp.float32) ** 2),
                                   jnp.sum(deq.astype(w.dtype) == w), w.size])  # fmt: skip
    return sums


def weight_error(qparams, params) -> dict:
    """Over the quantized weights: relative RMS error of their dequantization against the plain
    weights, and the fraction of elements equal to them after rounding to the plain dtype."""
    num, den, equal, count = np.asarray(_weight_sums(qparams["layers"], params["layers"]))
    if not count:
        return {"weight_rel_rms_error": 0.0, "weight_exact_fraction": 1.0}
    return {"weight_rel_rms_error": float(f"{math.sqrt(num / den):.4g}"),
            "weight_exact_fraction": round(float(equal / count), 6)}  # fmt: skip


def gguf_types(model: str, cfg) -> dict:
    """For a model read from a GGUF file: the GGML type of each stored tensor kind (the layers'
    linears, the embedding), and the weight format that holds the layers' blocks as stored."""
    path = model_path(model)
    if not is_gguf(path):
        return {}
    file = open_gguf(path)
    types: dict[str, set] = {}
    for name in file.names():
        kind = ".".join(p for p in name.split(".") if not p.isdigit())
        types.setdefault(kind, set()).add(file.type_of(name))
    native, per_weight = file.native_recipe(cfg)
    return {
        "gguf_tensor_types": {k: sorted(map(str, v)) for k, v in sorted(types.items())},
        "gguf_native_layer_format": native if not per_weight else "mixed",
        **({"note": SMOLLM2_NOTE} if model == "smollm2" else {}),
    }


class ModelBench:
    """One model's reference: its windows, prompts, continuation and logits; `score(fmt)` is the
    row of a format."""

    def __init__(self, model: str, args: argparse.Namespace):
        t0 = time.perf_counter()
        self.model, self.text, self.args = model, MODEL_TEXT[model], args
        self.cfg, self.params, self.tokenizer = load_model(model, dtype=args.dtype)
        load_s = time.perf_counter() - t0
        windows, _, stream = heldout_windows(self.tokenizer, self.text, args.seq_len,
                                             args.batch_size, args.max_windows,
                                             args.heldout_fraction)  # fmt: skip
        self.batch = min(args.batch_size, len(windows))
        self.num_tokens = len(windows) * args.seq_len
        logits_bytes = self.num_tokens * self.cfg.vocab_size * 4
        if logits_bytes > REF_CACHE_BYTES:
            raise ValueError(f"the reference logits of {len(windows)} windows take "
                             f"{logits_bytes / 2**30:.1f} GiB, over {REF_CACHE_BYTES / 2**30:.0f}"
                             " GiB: lower --max-windows")  # fmt: skip
        self.windows = jnp.asarray(windows.reshape(-1, self.batch, args.seq_len + 1))
        every = eval_windows(stream, args.seq_len)
        if len(every) < args.num_prompts:
            raise ValueError(
                f"{len(every)} held-out windows, fewer than {args.num_prompts} prompts"
            )
        picks = np.linspace(0, len(every) - 1, args.num_prompts).round().astype(int)
        prompts = every[picks, : args.prompt_tokens]
        t0 = time.perf_counter()
        generated = np.asarray(greedy_generate(self.params, self.cfg, prompts.tolist(),
                                               args.gen_tokens), np.int32)  # fmt: skip
        generate_s = time.perf_counter() - t0
        # Teacher-forced: the prompt and the continuation but its last token; the predictions
        # from position prompt_tokens - 1 on are of the continuation's tokens.
        self.forced = jnp.asarray(np.concatenate([prompts, generated[:, :-1]], axis=1))
        t0 = time.perf_counter()
        self.ref_logits = _window_logits(self.params, self.windows, cfg=self.cfg)
        self.reference = self._run(self.cfg, self.params)  # the reference tokens: its own argmax
        self.greedy_ref = self.reference[1]
        self.calibration = None
        self.info = {
            "text": self.text,
            "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.params))),
            "vocab_size": self.cfg.vocab_size,
            "heldout_windows": len(windows),
            "heldout_tokens_scored": self.num_tokens,
            "load_s": round(load_s, 2),
            "reference": {
                "generate_s": round(generate_s, 2),
                "score_s": round(time.perf_counter() - t0, 2),
                "generated_with": "jaxinfer.generate.greedy_generate (paged KV cache), EOS "
                                  "ignored",
                "prompt_windows": picks.tolist(),
                "generated_vs_teacher_forced_mismatches": int((generated != self.greedy_ref).sum()),
                "first_continuation": generated[0, :32].tolist(),
            },
            **gguf_types(model, self.cfg),
        }  # fmt: skip

    def _run(self, cfg, params) -> tuple[np.ndarray, np.ndarray]:
        sums, greedy = _score(params, self.windows, self.ref_logits, self.forced, cfg=cfg,
                              start=self.args.prompt_tokens - 1)  # fmt: skip
        return np.asarray(sums, np.float64).sum(axis=0), np.asarray(greedy)

    def quantized(self, fmt: str):
        if fmt == "none":
            return self.cfg, self.params
        calibration = None
        if fmt == "fp8_static":
            if self.calibration is None:
                self.calibration = calibration_windows(self.tokenizer, self.text,
                                                       self.batch, self.args.seq_len,
                                                       self.args.heldout_fraction)  # fmt: skip
            calibration = [self.calibration[0]]
        return quantize(self.cfg, self.params, weights=fmt, calibration=calibration)

    def score(self, fmt: str) -> dict:
        t0 = time.perf_counter()
        qcfg, qparams = self.quantized(fmt)
        jax.block_until_ready(qparams)
        quantize_s = time.perf_counter() - t0
        row = {"format": fmt, **weight_error(qparams, self.params)}
        if fmt == "fp8_static":
            row["calibration"] = self.calibration[1]
        t0 = time.perf_counter()
        (nll, kl, top1), greedy = self.reference if fmt == "none" else self._run(qcfg, qparams)
        score_s = time.perf_counter() - t0
        n = self.num_tokens
        same = greedy == self.greedy_ref
        first = np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))
        return row | {
            "nats_per_token": nll / n,
            "perplexity": round(math.exp(nll / n), 4),
            "kl_mean": float(f"{kl / n:.4g}"),
            "heldout_top1_agreement": round(top1 / n, 5),
            "greedy_agreement": round(float(same.mean(axis=1).mean()), 5),
            "greedy_first_disagreement_mean": round(float(first.mean()), 2),
            "greedy_prompts_fully_agreeing": int(same.all(axis=1).sum()),
            "quantize_s": round(quantize_s, 2),
            "score_s": round(score_s, 2),
        }


def finish_row(row: dict, reference_nats: float | None) -> dict:
    """The row with its perplexity change against the reference's `reference_nats` per token
    (unrounded) and the seeds' verdicts."""
    if reference_nats is None or "nats_per_token" not in row:
        return row
    change = 100 * math.expm1(row["nats_per_token"] - reference_nats)
    row["ppl_change_pct"] = round(change, 4)
    row["claims"] = claim_verdicts(row["format"], change)
    row["nats_per_token"] = round(row["nats_per_token"], 6)
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    formats = [f for f in FORMATS if f != "none"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    width = 0.8 / max(1, len(models))
    x = np.arange(len(formats))
    for k, model in enumerate(models):
        rows = {r["format"]: r for r in result["rows"] if r["model"] == model}
        for ax, key in zip(axes, ("ppl_change_pct", "greedy_agreement"), strict=True):
            ys = [rows.get(f, {}).get(key, np.nan) for f in formats]
            label = f"{model} ({MODEL_TEXT[model]})"
            ax.bar(x + (k - (len(models) - 1) / 2) * width, ys, width, label=label)
    axes[0].set_yscale("symlog", linthresh=0.01)
    axes[0].set_ylabel("perplexity change vs reference (%)")
    axes[0].axhline(0, color="black", lw=0.5)
    for c in CLAIMS:  # the seed 004 claimed ranges, per format
        if c["seed"] != SEED_004:
            continue
        lo, hi = c["range_pct"]
        for f in c["formats"]:
            i = formats.index(f)
            axes[0].plot([i - 0.45, i + 0.45], [hi, hi], color="grey", ls="--", lw=1)
            if lo is not None:
                axes[0].plot([i - 0.45, i + 0.45], [lo, lo], color="grey", ls=":", lw=1)
    axes[0].set_title(f"dashed/dotted: claimed loss range ({SEED_004})", fontsize=9)
    axes[1].set_ylabel(f"greedy agreement ({result['settings']['gen_tokens']} tokens)")
    agreements = [r["greedy_agreement"] for r in result["rows"] if "greedy_agreement" in r]
    axes[1].set_ylim(math.floor(10 * min(agreements, default=0)) / 10, 1.005)
    axes[1].set_xticks(x, formats, rotation=30, ha="right")
    axes[0].legend()
    fig.suptitle(f"Weight formats vs the plain model ({result['dtype']}, {result['device']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_TEXT), choices=list(MODEL_TEXT))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                    help="the reference row 'none' is always scored first")  # fmt: skip
    ap.add_argument("--max-windows", type=int, default=64, help="held-out windows scored")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--dtype", default=None, help=DTYPE_NOTE)
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of both metrics per format")
    ap.add_argument("--replot", action="store_true",
                    help="only draw --plot from the results already in --out")  # fmt: skip
    args = ap.parse_args(argv)
    if args.replot:
        if args.plot is None:
            ap.error("--replot needs --plot")
        result = json.loads(args.out.read_text())
        plot(result, args.plot)
        return result
    if args.prompt_tokens > args.seq_len:
        ap.error("--prompt-tokens must fit in a window (--seq-len)")
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    formats = ["none", *(f for f in dict.fromkeys(args.formats) if f != "none")]
    command = None if argv is None else [sys.executable, __file__, *argv]
    t_start = time.perf_counter()
    result = {
        **provenance(command),
        "dtype": args.dtype,
        "dtype_note": DTYPE_NOTE,
        "corpus_python": sys.version.split()[0],  # the stdlib corpus differs between versions
        "settings": {k: getattr(args, k) for k in ("max_windows", "seq_len", "batch_size",
                     "num_prompts", "gen_tokens", "prompt_tokens", "heldout_fraction")},
        "metrics": {
            "ppl_change_pct": "100 * (perplexity / reference perplexity - 1)",
            "kl_mean": "mean over the held-out predicted tokens of KL(ref || quant), nats, fp32",
            "greedy_agreement": "fraction of the continuation's positions whose teacher-forced "
                                "argmax is the reference's (mean over prompts)",
            "greedy_first_disagreement_mean": "mean over prompts of the first disagreeing "
                                              "position (gen_tokens if none)",
            "weight_rel_rms_error": "||dequantized - plain|| / ||plain|| over the quantized "
                                    "linear weights",
            "claims": "the seeds' quality-loss claims covering the format; verdict of "
                      "ppl_change_pct against the claimed range (below: less loss than claimed)",
        },
        "claims": [dict(c, formats=list(c["formats"])) for c in CLAIMS],
        "models": {},
        "rows": [],
    }  # fmt: skip
    for model in args.models:
        try:
            bench = ModelBench(model, args)
        except Exception as e:  # recorded; the next model runs
            result["models"][model] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            write(args.out, result)
            continue
        result["models"][model] = bench.info
        reference_nats = None
        for fmt in formats:
            try:
                row = {"model": model, **bench.score(fmt)}
            except Exception as e:  # recorded; the next format runs
                traceback.print_exc()
                row = {"model": model, "format": fmt, "error": f"{type(e).__name__}: {e}"}
            if fmt == "none" and "error" not in row:
                reference_nats = row["nats_per_token"]
            result["rows"].append(finish_row(row, reference_nats))
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            write(args.out, result)
            shown = ("perplexity", "ppl_change_pct", "kl_mean", "greedy_agreement", "score_s")
            print(json.dumps({"model": model, "format": fmt,
                              **{k: row.get(k) for k in shown if k in row},
                              **({"error": row["error"]} if "error" in row else {})}),
                  flush=True)  # fmt: skip
        del bench
    if args.plot is not None:
        plot(result, args.plot)
        result["plot"] = str(args.plot)
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write(args.out, result)
    return result


if __name__ == "__main__":
    main()
