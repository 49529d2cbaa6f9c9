"""`jaxinfer` command line.

jaxinfer quickstart [--out runs/quickstart]      greedy generation with a tiny model (CPU or GPU)
jaxinfer generate --model MODEL --prompt TEXT    continuation (or --chat MESSAGE: a reply) from a model
jaxinfer run CONFIG [k=v ...]                    one serving experiment (experiment/run.py)
jaxinfer sweep CONFIG [k=v ...] [--grid k=a,b]   a parameter sweep of `run` (experiment/sweep.py)
jaxinfer serve [CONFIG] [--model M] [k=v ...]    an OpenAI-compatible server (serve/server.py)
jaxinfer bench serve --base-url URL [k=v ...]    online benchmark of such a server (serve/bench.py)

Options and positionals may come in any order. A user's error (a config value, a checkpoint, a
missing file) is one line, `jaxinfer COMMAND: error: MESSAGE`, exit status 2; `jaxinfer --debug
COMMAND ...` raises it with its traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf.errors import OmegaConfBaseException

from jaxinfer import __version__
from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.config_file import check_overrides, config_error_message, to_yaml
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
    # One jitted forward of every sequence padded at the end to one length (a causal model's
    # logits at a position never see later ones): one compile, not one per op and length.
    seqs = [prompt + out for prompt, out in zip(prompts, outputs, strict=True)]
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for row, seq in zip(padded, seqs, strict=True):
        row[: len(seq)] = seq
    full = jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray(padded))
    refs = np.asarray(jnp.argmax(full, axis=-1))
    mismatches = 0
    for ref, prompt, out in zip(refs, prompts, outputs, strict=True):
        mismatches += int(
            (ref[len(prompt) - 1 : len(prompt) + len(out) - 1] != np.asarray(out)).sum()
        )
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
    from jaxinfer.experiment.run import fresh_results_dir

    out = fresh_results_dir(args.out, overwrite=args.overwrite)  # never another run's folder
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    for sample in samples[:3]:
        print(f"--- {model_name}, greedy\n{sample}")
    print(
        f"---\n{len(prompts)} prompts, {new_tokens} tokens in {elapsed:.3f}s "
        f"({metrics['output_tok_s']} tok/s) on {metrics['device']}; "
        f"paged decode vs full forward mismatches: {mismatches}"
    )
    print(f"results: {out}")
    return 0 if mismatches == 0 else 1


def _read_prompts(path: Path) -> list[str]:
    """Prompts of a file: JSON lines (strings, or objects with a "prompt") for *.jsonl, else one
    prompt per line."""
    text = path.read_text()
    if path.suffix != ".jsonl":
        return [line for line in text.splitlines() if line.strip()]
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f'{path}:{n}: expected a string or an object with a "prompt"')
        prompts.append(prompt)
    return prompts


# `generate` flags that are SamplingParams and EngineConfig fields: those given are passed on
# (the others are absent from the parsed arguments, and the classes' own defaults apply)
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")  # fmt: skip
ENGINE_FLAGS = ("dtype", "max_model_len")


def _engine_overrides(overrides: list[str]) -> dict:
    """`engine.KEY=VALUE` overrides as EngineConfig keyword arguments (nested for dotted keys)."""
    from omegaconf import OmegaConf

    for o in overrides:
        if not o.startswith("engine."):
            raise ValueError(f"override {o!r}: generate takes engine.KEY=VALUE overrides")
    return OmegaConf.to_container(OmegaConf.from_dotlist(overrides)).get("engine", {})


def generate(args: argparse.Namespace) -> int:
    """Continuations of prompts through the engine, with vLLM's sampling flags."""
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.progress import announce_if_slow

    prompts = list(args.prompt or [])
    for path in args.prompts_file or []:
        prompts += _read_prompts(path)
    if bool(prompts) == bool(args.chat):
        print("jaxinfer generate: error: give --prompt/--prompts-file or --chat", file=sys.stderr)
        return 2
    given = vars(args)
    sampling = SamplingParams(max_tokens=args.max_tokens,
                              **{k: given[k] for k in SAMPLING_FLAGS if k in given})  # fmt: skip
    rows = (
        1 << max(0, len(prompts or args.chat) - 1).bit_length()
    )  # one decode bucket holding them all
    engine = dict(max_num_seqs=rows, decode_buckets=[rows], max_num_batched_tokens=max(512, rows),
                  penalties=sampling.uses_penalties)  # fmt: skip
    engine |= {k: given[k] for k in ENGINE_FLAGS if k in given} | _engine_overrides(args.overrides)
    with announce_if_slow(f"jaxinfer generate: loading {args.model}..."):
        llm = LLM(str(args.model), warmup=False, **engine)
    # (no warm-up: only the steps these prompts use compile, on first use)
    generating = announce_if_slow("jaxinfer generate: generating (the first step compiles)...")
    cfg = llm.engine.model_config
    if args.chat:  # each message a conversation of its own, under the model's chat template
        system = [{"role": "system", "content": args.system}] if args.system else []
        conversations = [[*system, {"role": "user", "content": m}] for m in args.chat]
        with generating:
            outs = llm.chat(conversations, sampling)
        for message, out in zip(args.chat, outs, strict=True):
            if args.json:
                print(json.dumps({"message": message, "text": out.text,
                                  "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                  "error": out.error}))  # fmt: skip
            elif out.error:
                print(f"[error] {out.error}", file=sys.stderr)
            else:
                print(out.text)
        return 0 if any(o.error is None for o in outs) else 1
    from jaxinfer.assets import model_path
    from jaxinfer.checkpoint.gguf_io import is_gguf

    # A HF directory's BOS first, as transformers' generate sees it; a GGUF's tokenizer adds it
    # itself when the file says so (tokenizer.ggml.add_bos_token), as llama.cpp does.
    add_bos = cfg.bos_token_id is not None and not is_gguf(model_path(str(args.model)))
    ids = []
    for prompt in prompts:
        toks = list(llm.tokenizer.encode(prompt).ids) if llm.tokenizer is not None else None
        if toks is None:
            raise ValueError(f"model {str(args.model)!r} has no tokenizer for text prompts")
        if add_bos and (not toks or toks[0] != cfg.bos_token_id):
            toks = [cfg.bos_token_id, *toks]
        ids.append(toks)
    with generating:
        outs = llm.generate(ids, sampling)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "error": out.error}))  # fmt: skip
        elif out.error:
            print(f"[error] {out.error}", file=sys.stderr)
        else:
            print(prompt + out.text)
    return 0 if any(o.error is None for o in outs) else 1


def train(args: argparse.Namespace) -> int:
    """Train (or resume) a reference model, export it in HF format, report held-out perplexity."""
    from jaxinfer.train.config import load_train_config
    from jaxinfer.train.eagle import is_eagle_config, load_eagle_config, train_eagle

    if is_eagle_config(args.config, args.overrides):  # an EAGLE draft head (train/eagle.py)
        tc = load_eagle_config(args.config, args.overrides)
        try:
            summary = train_eagle(tc)
        except KeyboardInterrupt:  # a head trains in minutes and keeps no checkpoint
            print(f"jaxinfer train: interrupted; {tc.out_dir}/log.jsonl keeps the held-out "
                  "evaluations so far, and rerunning starts the head over", file=sys.stderr)  # fmt: skip
            return 130
        print(json.dumps({k: summary[k] for k in ("name", "head_params", "heldout_agreement")}))
        return 0
    tc = load_train_config(args.config, args.overrides)
    try:
        return _train(tc, args)
    except KeyboardInterrupt as e:  # one line, as `run` prints: the checkpoints are the work kept
        print(f"jaxinfer train: {str(e) or 'interrupted; rerunning resumes'}", file=sys.stderr)
        return 130


def _train(tc, args: argparse.Namespace) -> int:
    """Train (or resume) `tc`, export it to `out_dir/hf`, write its metrics.json."""
    from jaxinfer.checkpoint import save_hf_model
    from jaxinfer.train.evaluate import heldout_perplexity
    from jaxinfer.train.trainer import train as run_training

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
        row = heldout_perplexity(model, text=args.text, seq_len=args.seq_len,
                                 max_windows=args.max_windows,
                                 show_progress=not args.no_progress)  # fmt: skip
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**provenance(), "rows": rows}, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    """One serving experiment from a YAML config with dotted overrides, into a results folder of
    its own (see RUN_DESCRIPTION)."""
    from jaxinfer.experiment import run as runs

    rc = runs.load_run_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(rc), end="")
        return 0
    if _join_multihost():  # another host's process of a multi-host engine: process 0 runs it
        from jaxinfer.engine.follower import follow

        runs.preflight(rc)  # (a config that fails on process 0 ends this one too)
        follow(rc.engine)
        return 0
    runs.preflight(rc)  # (before a folder is taken)
    out = runs.fresh_results_dir(rc.out_dir, overwrite=args.overwrite)
    if out != Path(rc.out_dir):
        print(f"{rc.out_dir} is in use: this run writes to {out} (--overwrite: write there)")
    rc = dataclasses.replace(rc, out_dir=str(out))
    try:
        with runs.stop_on_signals():
            metrics = runs.run_experiment(rc, show_progress=not args.no_progress)
    except runs.RunInterrupted as e:
        print(f"jaxinfer run: {e}", file=sys.stderr)
        e.exit_now_if_compiling()
        return e.exit_code
    print(f"results: {out}\nreport:  jaxinfer report {shlex.quote(str(out))}")
    if not metrics["num_completed"]:
        print(
            f"jaxinfer run: error: none of the {metrics['num_requests']} requests succeeded (the "
            f"reasons above; every one in {out / 'metrics.json'})",
            file=sys.stderr,
        )
        return 1
    return 0 if metrics.get("compiles_after_warmup") in (0, None) else 1


def sweep(args: argparse.Namespace) -> int:
    """Run every point of a parameter sweep (grid x zip) and merge their metrics into one table."""
    from jaxinfer.experiment.run import RunInterrupted
    from jaxinfer.experiment.sweep import parse_axes, plan_sweep, run_sweep

    try:  # (a ValueError, of the sweep or its worker settings, is main's; points record theirs)
        plan = plan_sweep(
            args.config, args.overrides, grid=parse_axes(args.grid), zipped=parse_axes(args.zip)
        )
        result = run_sweep(
            plan, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
            show_progress=not args.no_progress,
        )  # fmt: skip
    except KeyboardInterrupt as e:
        print("jaxinfer sweep: interrupted; the same command resumes it", file=sys.stderr)
        if isinstance(e, RunInterrupted):
            e.exit_now_if_compiling()
        return 130
    return 0 if result.ok else 1


def _config_and_overrides(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    """The optional CONFIG positional, and the overrides: a first `key=value` is one of them."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in str(config) and not config.exists():
        config, overrides = None, [str(config), *overrides]
    return config, overrides


def serve(args: argparse.Namespace) -> int:
    """Load and warm the model, then serve the OpenAI API until interrupted."""
    from jaxinfer.serve.server import Server, build_llm, load_serve_config

    config, overrides = _config_and_overrides(args)
    for flag, key in ((args.model, "engine.model"), (args.host, "serve.host"),
                      (args.port, "serve.port")):  # fmt: skip
        if flag is not None:
            overrides.append(f"{key}={flag}")
    sc = load_serve_config(config, overrides)
    if _join_multihost():  # another host's process of a multi-host engine: process 0 serves
        from jaxinfer.engine.follower import follow

        follow(sc.engine)
        return 0
    from jaxinfer.progress import CompileProgress

    print(f"jaxinfer serve: loading {sc.engine.model} and compiling every batch shape...",
          flush=True)  # fmt: skip
    llm = build_llm(sc, progress=CompileProgress("jaxinfer serve"))
    try:
        server = Server(llm, sc.serve)
        print(f"jaxinfer serve: {sc.engine.model} at {server.base_url} (Ctrl-C stops)",
              flush=True)  # fmt: skip
        try:
            server.serve_forever()
        except KeyboardInterrupt:  # Ctrl-C before uvicorn was up: it re-raises that one
            server.signals.append(signal.SIGINT)
        if server.signals:
            name = "Ctrl-C" if signal.SIGINT in server.signals else "SIGTERM"
            print(f"jaxinfer serve: stopped on {name}; {server.streams_ended} open stream(s) "
                  "ended with an error event", file=sys.stderr)  # fmt: skip
            return 130 if signal.SIGINT in server.signals else 143
    finally:
        llm.close()  # (a multi-host engine's other processes exit)
    return 0


def _join_multihost() -> bool:
    """Join a multi-host launch when JAX_COORDINATOR_ADDRESS is set (before any device is
    touched: `parallel/multihost.py`); whether this process is a follower (not process 0)."""
    from jaxinfer.parallel import multihost

    return multihost.initialize_from_env() and multihost.is_follower()


def bench_serve(args: argparse.Namespace) -> int:
    """Benchmark an OpenAI-compatible server with a workload, measured at the client."""
    from jaxinfer.experiment.run import fresh_results_dir
    from jaxinfer.serve.bench import load_bench_config, run_bench

    config, overrides = _config_and_overrides(args)
    for flag, key in ((args.base_url, "base_url"), (args.model, "model"),
                      (args.endpoint, "endpoint"), (args.max_concurrency, "max_concurrency"),
                      (args.num_prompts, "workload.num_requests"), (args.out, "out_dir")):  # fmt: skip
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.request_rate is not None:
        process = "poisson" if args.burstiness in (None, 1.0) else "gamma"
        overrides += [f"workload.arrival.process={process}",
                      f"workload.arrival.rate={args.request_rate}"]  # fmt: skip
        if args.burstiness is not None:
            overrides.append(f"workload.arrival.burstiness={args.burstiness}")
    bc = load_bench_config(config, overrides)
    out = fresh_results_dir(bc.out_dir, overwrite=args.overwrite)
    bc = dataclasses.replace(bc, out_dir=str(out))
    metrics = run_bench(bc, show_progress=not args.no_progress)
    print(f"results: {out}\nreport:  jaxinfer report {shlex.quote(str(out))}")
    return 0 if metrics["num_completed"] else 1


def report(args: argparse.Namespace) -> int:
    """Markdown report with plots of run or sweep results folders."""
    from jaxinfer.experiment.report import default_out, write_report

    path = write_report(args.results, args.out or default_out(args.results), args.x, args.title)
    print(f"report: {path}")
    return 0


RUN_DESCRIPTION = """\
One serving experiment: the YAML config, the dotted key=value overrides applied over it, run on
the wall clock into its out_dir: config.yaml (resolved), env.json, requests.parquet,
steps.parquet and metrics.json (summary, times in seconds). --print-config shows the resolved
config, every key with its value.

config sections (the schema, every key's type, default and allowed values: the dataclasses named)
  name      the run's name (str)
  out_dir   its results folder (default runs/${name}). One that holds anything already is never
            written into: the run takes a new timestamped sibling, unless --overwrite
  engine    EngineConfig, jaxinfer/engine/config.py: model, dtype, KV pages, batch limits,
            scheduler, allocation, chunked prefill, decode steps, attention backend, mesh
  workload  WorkloadSpec, jaxinfer/workload/spec.py: kind, num_requests, prompt_len and
            output_len (LengthSpec), arrival (ArrivalSpec), seed, trace_path
  sampling  SamplingDefaults, jaxinfer/experiment/run.py: temperature, top_k, top_p, min_p,
            ignore_eos, max_tokens
  slo       SLOSpec, jaxinfer/experiment/run.py: ttft and tpot in seconds (goodput and SLO
            attainment in the metrics)

exit status: 0 done (some requests may have failed: the summary says which and why); 1 no request
succeeded, or something compiled after the warm-up; 2 a config error (one line); 130 / 143
stopped by SIGINT / SIGTERM, what ran kept."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (not a None / False / empty one: the help says what
    leaving it out means); descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or (isinstance(d, list | tuple) and not d):
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: options and positionals in any order (`sweep CONFIG --grid k=a,b
    more=overrides`), by argparse's intermixed parsing, which the top-level parser (it has
    subcommands) cannot use; help through `HelpFormatter`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._parsing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._parsing or self._subparsers is not None:  # (intermixed: no subcommands)
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxinfer", description="JAX LLM inference research", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="raise errors with their traceback, not in one line"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    q = sub.add_parser("quickstart", help="greedy generation with the shipped tiny model")
    q.add_argument("--preset", default=None, help="random weights of this preset's shape instead")
    q.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")
    q.add_argument("--seed", type=int, default=0, help="page shuffling (and a preset's weights)")
    q.add_argument("--out", type=Path, default=Path("runs/quickstart"),
                   help="results folder; one holding anything gets a timestamped sibling")  # fmt: skip
    q.add_argument("--overwrite", action="store_true", help="write into --out even if it is used")
    q.set_defaults(func=quickstart)
    g = sub.add_parser("generate", help="continue prompts, or answer chat messages, with a model "
                       "(a Hugging Face directory, a .gguf file, tiny, smollm2, or preset:NAME)")  # fmt: skip
    g.add_argument("--model", required=True,
                   help="HF model directory, .gguf file, tiny, smollm2, or preset:NAME")  # fmt: skip
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--chat", action="append", metavar="MESSAGE",
                   help="a user message, answered under the model's chat template (repeat for "
                        "several conversations)")  # fmt: skip
    g.add_argument("--system", default=None, help="system message for --chat (default: the "
                   "template's own)")  # fmt: skip
    g.add_argument("--prompts-file", type=Path, action="append",
                   help="prompts, one per line (or JSON lines in a .jsonl file)")  # fmt: skip
    g.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32,
                   help="tokens to generate per prompt")  # fmt: skip
    unset = argparse.SUPPRESS  # (SAMPLING_FLAGS and ENGINE_FLAGS: their classes' defaults)
    g.add_argument("--temperature", type=float, default=unset, help="0 (default): greedy")
    g.add_argument("--top-p", type=float, default=unset, help="nucleus mass kept (1: off)")
    g.add_argument("--top-k", type=int, default=unset, help="tokens kept (0 or -1: off)")
    g.add_argument("--min-p", type=float, default=unset, help="min probability / top's (0: off)")
    g.add_argument("--seed", type=int, default=unset, help="per-request seed (default: random)")
    g.add_argument("--repetition-penalty", type=float, default=unset,
                   help="on the prompt's and output's tokens (1: off)")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=unset, help="per token (0: off)")
    g.add_argument("--frequency-penalty", type=float, default=unset,
                   help="per occurrence in the output (0: off)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=unset,
                   help="engine.max_model_len: prompt + output tokens")  # fmt: skip
    g.add_argument("--dtype", default=unset, help="engine.dtype: weights and activations (auto, "
                   "the default: float32 on a CPU, else bfloat16)")  # fmt: skip
    g.add_argument("overrides", nargs="*", help="engine.KEY=VALUE overrides (EngineConfig, "
                   "jaxinfer/engine/config.py), as in engine.kv_dtype=float8_e4m3fn")  # fmt: skip
    g.add_argument("--json", action="store_true",
                   help="one JSON object per prompt: prompt, text, token_ids, finish_reason, error")  # fmt: skip
    g.set_defaults(func=generate)
    r = sub.add_parser("run", help="run a serving experiment config", description=RUN_DESCRIPTION)
    r.add_argument("config", type=Path, help="YAML run config (sections below)")
    r.add_argument("overrides", nargs="*", help="optional dotted key=value overrides, as in "
                   "engine.page_size=32 (in any order with the options)")  # fmt: skip
    r.add_argument("--overwrite", action="store_true",
                   help="write into out_dir even if it holds an earlier run (default: a new "
                        "timestamped sibling)")  # fmt: skip
    r.add_argument("--print-config", action="store_true", help="print the resolved config; no run")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=run)
    w = sub.add_parser("sweep", help="run a grid/zip sweep of a serving experiment config")
    w.add_argument("config", type=Path, help="run config, optionally with a `sweep:` section")
    w.add_argument("overrides", nargs="*", help="dotted key=value overrides for every point")
    w.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="cartesian axis")
    w.add_argument("--zip", action="append", metavar="KEY=V1,V2", help="axis zipped with others")
    w.add_argument("--workers", type=int, default=1, help="worker processes (1: in-process)")
    w.add_argument("--gpus-per-worker", type=int, default=1, help="GPUs pinned per worker")
    w.add_argument("--no-progress", action="store_true", help="no progress bars")
    w.set_defaults(func=sweep)
    t = sub.add_parser("train", help="train a reference model on the stdlib corpus")
    t.add_argument("config", type=Path, help="YAML train config (jaxinfer/train/config.py)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the exported Hugging Face weights")  # fmt: skip
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=train)
    e = sub.add_parser("eval-ppl", help="perplexity of models on text they were not trained on")
    e.add_argument("models", nargs="+",
                   help="models: HF directories, .gguf files, or names (tiny, smollm2)")  # fmt: skip
    e.add_argument("--text", default="code", choices=["code", "english"],
                   help="held-out stdlib files, or the Python docs' topics and held-out module "
                        "docstrings")  # fmt: skip
    e.add_argument("--seq-len", type=int, default=256, help="tokens per evaluation window")
    e.add_argument("--max-windows", type=int, default=None, help="at most this many (default: all)")
    e.add_argument("--out", type=Path, default=None, help="JSON results file (default: none)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.set_defaults(func=eval_ppl)
    v = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    v.add_argument("config", type=Path, nargs="?", default=None,
                   help="YAML with an engine: section (a run config works) and an optional "
                        "serve: section (jaxinfer/serve/server.py: ServeOptions)")  # fmt: skip
    v.add_argument("overrides", nargs="*", help="dotted key=value overrides, as in "
                   "engine.max_num_seqs=64 serve.max_queue=512")  # fmt: skip
    v.add_argument("--model", default=None, help="engine.model: tiny, smollm2, preset:NAME, a "
                   "HF directory or a .gguf file")  # fmt: skip
    v.add_argument("--host", default=None, help="serve.host (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=None, help="serve.port (default 8000)")
    v.set_defaults(func=serve)
    b = sub.add_parser("bench", help="benchmarks: `bench serve` measures a running server")
    bsub = b.add_subparsers(dest="bench_command", required=True, parser_class=CommandParser,
                            help="serve: an OpenAI-compatible server, from its clients' side")  # fmt: skip
    bs = bsub.add_parser("serve", help="online benchmark of an OpenAI-compatible server",
                         description="Client-side TTFT, TPOT, ITL, E2E, goodput and throughput "
                         "of a workload sent to an OpenAI-compatible server, as vllm bench "
                         "serve defines them (jaxinfer/serve/bench.py says where they differ); "
                         "results in a run folder `jaxinfer report` reads.")  # fmt: skip
    bs.add_argument("config", type=Path, nargs="?", default=None,
                    help="YAML: a run config's workload / slo sections, or a bench config "
                         "(jaxinfer/serve/bench.py: BenchConfig)")  # fmt: skip
    bs.add_argument("overrides", nargs="*", help="dotted key=value overrides, as in "
                    "workload.num_requests=200 slo.ttft=0.5")  # fmt: skip
    bs.add_argument("--base-url", default=None, help="the server's API root (default "
                    "http://127.0.0.1:8000/v1)")  # fmt: skip
    bs.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    bs.add_argument("--endpoint", default=None, choices=["completions", "chat"])
    bs.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    bs.add_argument("--request-rate", type=float, default=None,
                    help="Poisson arrivals at this rate (req/s; inf: all at once)")  # fmt: skip
    bs.add_argument("--burstiness", type=float, default=None,
                    help="gamma arrivals of this shape at --request-rate (1: Poisson)")  # fmt: skip
    bs.add_argument("--num-prompts", type=int, default=None, help="workload.num_requests")
    bs.add_argument("--out", default=None, help="results folder (default runs/bench_serve)")
    bs.add_argument("--overwrite", action="store_true", help="write into --out even if used")
    bs.add_argument("--no-progress", action="store_true", help="no progress bar")
    bs.set_defaults(func=bench_serve)
    p = sub.add_parser("report", help="Markdown report and plots of run or sweep results")
    p.add_argument("results", nargs="+", type=Path, help="run or sweep folders (several: compared)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: RESULTS/report/; for committed results under "
                        "experiments/results/, runs/report-<path below it>/")  # fmt: skip
    p.add_argument("--x", default=None, help="dotted key ordering the latency-throughput curve")
    p.add_argument("--title", default=None, help="default: from the folders' names")
    p.set_defaults(func=report)
    return parser


# A user's errors (a config value, a checkpoint, a path given), printed in one line.
USER_ERRORS = (OmegaConfBaseException, CheckpointError, ValueError, FileNotFoundError)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OmegaConfBaseException):
        return config_error_message(e)
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "overrides", None):
            check_overrides(args.overrides)
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"jaxinfer {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
