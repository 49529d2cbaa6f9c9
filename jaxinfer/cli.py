"""`jaxinfer` command line.

jaxinfer quickstart [--out runs/quickstart]      greedy generation with a tiny model (CPU or GPU)
jaxinfer generate --model HF_DIR --prompt TEXT   greedy continuation from a real checkpoint
jaxinfer sweep CONFIG [k=v ...] [--grid k=a,b]   a parameter sweep of `run` (experiment/sweep.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.generate import greedy_generate
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params, num_params
from jaxinfer.provenance import provenance

PYTHON_PROMPTS = (
    "import os\n\n\ndef ",
    "class Queue:\n    def __init__(self",
    "    for i in range(",
    "def read_lines(path):\n    with open(path) as f:\n",
    "        if not isinstance(value, str):\n            raise ",
    "    def __repr__(self):\n        return ",
    "try:\n    import ",
    "def _check(self, key):\n    ",
)


def quickstart(args: argparse.Namespace) -> int:
    """Greedy generation through shuffled pages, each token checked against a full forward pass.

    Default model: the shipped `tiny` reference model (trained on Python's stdlib) with Python
    prompts; `--preset NAME` uses random weights of that shape and random prompts instead.
    """
    tokenizer = None
    if args.preset is None:
        from jaxinfer.assets import reference_model_dir
        from jaxinfer.checkpoint import load_hf_model, load_tokenizer

        model_dir = reference_model_dir("tiny")
        cfg, params = load_hf_model(model_dir, dtype="float32")
        tokenizer = load_tokenizer(model_dir)
        prompts = [tokenizer.encode(p).ids for p in PYTHON_PROMPTS]
        model_name = "tiny (shipped, trained)"
    else:
        cfg = preset(args.preset)
        params = init_params(cfg, jax.random.key(args.seed))
        rng = np.random.default_rng(args.seed)
        lengths = rng.integers(4, 48, 8)
        prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lengths]
        model_name = f"{args.preset} (random weights)"
    page_size = 16

    greedy_generate(params, cfg, prompts, 2, page_size=page_size)  # compile both step shapes
    t0 = time.perf_counter()
    outputs = greedy_generate(
        params, cfg, prompts, args.max_new_tokens, page_size=page_size, shuffle_pages_seed=args.seed
    )
    elapsed = time.perf_counter() - t0
    # Self-check: each generated token is the argmax of a full (cache-free) forward over the prefix.
    mismatches = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        seq = jnp.asarray([prompt + out])
        ref = np.asarray(jnp.argmax(forward(params, cfg, seq)[0], axis=-1))
        mismatches += int((ref[len(prompt) - 1 : -1] != np.asarray(out)).sum())
    new_tokens = sum(len(o) for o in outputs)
    samples = [
        tokenizer.decode(p + o) if tokenizer else f"{p} -> {o}"
        for p, o in zip(prompts, outputs, strict=True)
    ]
    metrics = {
        **provenance(),
        "model": model_name,
        "num_params": num_params(cfg),
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": new_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tok_s": round(new_tokens / elapsed, 1),
        "paged_vs_full_forward_mismatches": mismatches,
        "samples": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    for sample in samples[:3]:
        print(f"--- {model_name}, greedy\n{sample}")
    print(
        f"---\n{len(prompts)} prompts, {new_tokens} tokens in {elapsed:.3f}s "
        f"({metrics['output_tok_s']} tok/s) on {metrics['device']}; "
        f"paged decode vs full forward mismatches: {mismatches}; wrote {args.out / 'metrics.json'}"
    )
    return 0 if mismatches == 0 else 1


def generate(args: argparse.Namespace) -> int:
    from jaxinfer.checkpoint import load_hf_model, load_tokenizer

    cfg, params = load_hf_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer.encode(args.prompt).ids
    if cfg.bos_token_id is not None and (not ids or ids[0] != cfg.bos_token_id):
        ids = [cfg.bos_token_id, *ids]
    (out,) = greedy_generate(
        params, cfg, [ids], args.max_new_tokens, eos_token_ids=cfg.eos_token_ids
    )
    print(args.prompt + tokenizer.decode(out))
    return 0


def train(args: argparse.Namespace) -> int:
    """Train (or resume) a reference model, export it in HF format, report held-out perplexity."""
    from jaxinfer.checkpoint import save_hf_model
    from jaxinfer.train.config import load_train_config
    from jaxinfer.train.evaluate import heldout_perplexity
    from jaxinfer.train.trainer import train as run_training

    tc = load_train_config(args.config, args.overrides)
    cfg, params, summary = run_training(tc, show_progress=not args.no_progress)
    out = Path(tc.out_dir)
    export = cfg.replace(param_dtype=args.export_dtype, dtype=args.export_dtype)
    hf_dir = save_hf_model(
        out / "hf", export, params, tokenizer_file=tc.tokenizer_path, dtype=args.export_dtype,
        force=True,
    )  # fmt: skip
    metrics = {**provenance(), **summary, **heldout_perplexity(hf_dir, seq_len=tc.seq_len)}
    metrics["model"] = tc.name
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: metrics[k] for k in ("model", "num_params", "perplexity")}))
    return 0


def eval_ppl(args: argparse.Namespace) -> int:
    """Held-out perplexity of HF model directories, appended as rows of one results file."""
    from jaxinfer.train.evaluate import heldout_perplexity

    rows = []
    for model in args.models:
        row = heldout_perplexity(model, seq_len=args.seq_len, max_windows=args.max_windows)
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**provenance(), "rows": rows}, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    """One serving experiment from a YAML config with dotted overrides."""
    from jaxinfer.experiment import run as runs

    try:
        rc = runs.load_run_config(args.config, args.overrides)
    except runs.SweepConfigError as e:
        print(f"jaxinfer run: error: {e}", file=sys.stderr)
        return 2
    try:
        with runs.stop_on_signals():
            metrics = runs.run_experiment(rc, show_progress=not args.no_progress)
    except runs.RunInterrupted as e:
        print(f"jaxinfer run: {e}", file=sys.stderr)
        e.exit_now_if_compiling()
        return e.exit_code
    return 0 if metrics.get("compiles_after_warmup") in (0, None) else 1


def sweep(args: argparse.Namespace) -> int:
    """Run every point of a parameter sweep (grid x zip) and merge their metrics into one table."""
    from jaxinfer.experiment.run import RunInterrupted
    from jaxinfer.experiment.sweep import parse_axes, plan_sweep, run_sweep

    try:
        plan = plan_sweep(
            args.config, args.overrides, grid=parse_axes(args.grid), zipped=parse_axes(args.zip)
        )
        result = run_sweep(
            plan, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
            show_progress=not args.no_progress,
        )  # fmt: skip
    except ValueError as e:  # the sweep or its worker settings; failing points are recorded
        print(f"jaxinfer sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("jaxinfer sweep: interrupted; the same command resumes it", file=sys.stderr)
        if isinstance(e, RunInterrupted):
            e.exit_now_if_compiling()
        return 130
    return 0 if result.ok else 1


def report(args: argparse.Namespace) -> int:
    """Markdown report with plots of run or sweep results folders."""
    from jaxinfer.experiment.report import default_out, write_report

    try:
        path = write_report(args.results, args.out or default_out(args.results), args.x, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxinfer report: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX LLM inference research")
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quickstart", help="greedy generation with the shipped tiny model")
    q.add_argument("--preset", default=None, help="random weights of this shape instead")
    q.add_argument("--max-new-tokens", type=int, default=32)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    q.set_defaults(func=quickstart)
    g = sub.add_parser("generate", help="greedy continuation from a Hugging Face model directory")
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--dtype", default="bfloat16")
    g.set_defaults(func=generate)
    r = sub.add_parser("run", help="run a serving experiment config")
    r.add_argument("config", type=Path)
    r.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=run)
    w = sub.add_parser("sweep", help="run a grid/zip sweep of a serving experiment config")
    w.add_argument("config", type=Path, help="run config, optionally with a `sweep:` section")
    w.add_argument("overrides", nargs="*", help="dotted key=value overrides for every point")
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="cartesian axis")
    w.add_argument("--zip", action="append", metavar="KEY=V1,V2", help="axis zipped with others")
    w.add_argument("--workers", type=int, default=1, help="worker processes (1: in-process)")
    w.add_argument("--gpus-per-worker", type=int, default=1, help="GPUs pinned per worker")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(func=sweep)
    t = sub.add_parser("train", help="train a reference model on the stdlib corpus")
    t.add_argument("config", type=Path)
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=train)
    e = sub.add_parser("eval-ppl", help="held-out perplexity of HF model directories")
    e.add_argument("models", nargs="+", type=Path)
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--out", type=Path, default=None)
    e.set_defaults(func=eval_ppl)
    p = sub.add_parser("report", help="Markdown report and plots of run or sweep results")
    p.add_argument("results", nargs="+", type=Path, help="run or sweep folders (several: compared)")
    p.add_argument("--out", type=Path, default=None, help="default: RESULTS/report/")
    p.add_argument("--x", default=None, help="dotted key ordering the latency-throughput curve")
    p.add_argument("--title", default=None)
    p.set_defaults(func=report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
