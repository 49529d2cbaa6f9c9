"""The seeds' claim "speculative decoding: 2-3x with the same output distribution": every
proposer against the same engine without speculation, in one run.

    python experiments/speculative/run.py --out experiments/results/cpu/speculative.json \
        --plot experiments/results/cpu/speculative.png                     # tiny + tiny-draft
    python3 experiments/speculative/run.py --model smollm2 --dtype bfloat16 \
        --methods none ngram self:10 --batches 1 8 64 --out $OUT/speculative.json  # H200

Each method runs in a process of its own (an engine built after others in one process can run
slower: jaxinfer/experiment/isolated.py) and builds one engine there (engine.max_num_seqs = the
largest batch; its warm-up, once, excluded; --num-pages 0, the default, sizes the KV cache so that
no point preempts), and for each workload and batch B generates B x --waves requests with B in
flight at a time: a finished request's slot takes the next prompt at once, as a server at
concurrency B does (a batch that waited for its slowest member would charge speculation, whose
sequences advance at different rates, for the wait), greedily (--temperature 0) or sampled, EOS
ignored, all to the same length; recorded: output tok/s, the speedup over "none" at the same
batch and workload, the draft acceptance rate, tokens per verification (tau) and acceptance by
draft position (`metrics.summary`), and whether the outputs equal "none"'s token for token
(they must: verification is exact). Methods: none, ngram[:GAMMA], draft:MODEL[:GAMMA],
self:LAYERS[:GAMMA], eagle:HEAD[:GAMMA] (HEAD: a head file from `jaxinfer train
configs/train/eagle-*.yaml`, or "random"; `engine.speculative`; GAMMA defaults to
--num-draft-tokens); a "+adaptive" suffix (ngram+adaptive) turns on
`engine.speculative.adaptive`, and the row records the fraction of decode steps that speculated
(`speculative_step_fraction`), the policy's rates per bucket after the point (`adaptive`) and
each of the point's scans as it measured them (`adaptive_trace`).

    python experiments/speculative/run.py --methods none ngram ngram+adaptive \
        eagle:eagle-tiny eagle:eagle-tiny+adaptive \
        --out experiments/results/cpu/speculative_adaptive.json          # adaptive, tiny, CPU

    python experiments/speculative/run.py --methods none ngram self:2 eagle:eagle-tiny \
        eagle:random --out experiments/results/cpu/speculative_eagle.json    # tiny's heads, CPU
    python experiments/speculative/run.py --model smollm2 --methods none ngram self:10 \
        eagle:eagle-smollm2 --batches 1 --max-tokens 64 \
        --out experiments/results/cpu/speculative_eagle_smollm2.json        # SmolLM2, CPU

Workloads (`jaxinfer/workload/code_prompts.py`, on Python source of the standard library, the
reference models' domain): "grounded", prompts that end asking for a copy of code they contain
(an input-grounded task where n-gram lookup pays: the output repeats the prompt), "open", the
same code without the request (free continuation), and "chat", a user turn under the model's
chat template asking to explain, comment or test the code (models with a chat template).

`--engine KEY=VALUE` sets an engine option for every method over the script's own (e.g.
compile_workers=1, or compiler_options.decode.xla_gpu_autotune_level=0, which replaces the
default compiler_options whole); the process's XLA_FLAGS are recorded (`env`).

`--profile DIR` adds, after each timed point, a jax.profiler trace of --profile-scans decode
scans of the point's first B prompts (untimed; traced once the first scan ran, so prefill is
left out) into DIR/<method>_<workload>_b<B>, and its device account per decode round to the
row (`profile`: device, span and idle ms, ms by kind of work, the top ops, the top gaps (the
idle time by the ops either side) and the share of kernels that started before the one before
ended): where a speculative round's time goes beside a plain one's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.experiment.isolated import in_own_process
from jaxinfer.metrics.device_trace import summarize_trace
from jaxinfer.metrics.summary import summarize
from jaxinfer.provenance import provenance, typed_command
from jaxinfer.workload.code_prompts import KINDS, prompt_text, snippets

SOURCES = ("textwrap", "shlex", "fnmatch", "heapq", "bisect", "colorsys", "string", "queue")


def prompts_of(workload: str, llm: LLM, n: int, chars: int) -> list[list[int]]:
    """n prompts of `workload` (`code_prompts.KINDS`) on pieces of the SOURCES modules."""
    pieces = snippets([inspect.getsource(__import__(name)) for name in SOURCES], n, chars)
    return [llm.tokenizer.encode(prompt_text(workload, s, i, llm.render_chat)).ids
            for i, s in enumerate(pieces)]  # fmt: skip


def speculative_config(method: str, gamma: int) -> dict:
    """`engine.speculative` of a method spec (see the module docstring)."""
    if method.endswith("+adaptive"):
        return {**speculative_config(method.removesuffix("+adaptive"), gamma), "adaptive": True}
    name, *args = method.split(":")
    if name == "none":
        return {"method": "none"}
    if name == "ngram":
        return {"method": "ngram", "num_draft_tokens": int(args[0]) if args else gamma}
    if name == "draft":
        g = int(args[1]) if len(args) > 1 else gamma
        return {"method": "draft", "draft_model": args[0], "num_draft_tokens": g}
    if name == "self":
        g = int(args[1]) if len(args) > 1 else gamma
        return {"method": "self", "draft_layers": int(args[0]), "num_draft_tokens": g}
    if name == "eagle" and args:
        g = int(args[1]) if len(args) > 1 else gamma
        return {"method": "eagle", "eagle_head": args[0], "num_draft_tokens": g}
    raise ValueError(f"--methods: {method!r} is not none, ngram[:G], draft:MODEL[:G], "
                     "self:LAYERS[:G] or eagle:HEAD[:G] (each with an optional +adaptive)")  # fmt: skip


PAGE_SIZE = 16


def pages_for(args, longest_prompt: int) -> int:
    """KV pages for max(--batches) sequences of the longest prompt and --max-tokens each, plus
    what a decode scan reserves ahead (two scans of --decode-steps rounds of 1 + gamma tokens)
    and the scratch page: no point preempts (a preemption's recompute would be timed). At least
    one request of --max-model-len (the engine's own floor)."""
    ahead = 2 * args.decode_steps * (1 + args.num_draft_tokens)
    per_seq = -(-(longest_prompt + args.max_tokens + ahead) // PAGE_SIZE)
    return max(max(args.batches) * per_seq, -(-args.max_model_len // PAGE_SIZE)) + 1


def build_engine(args, method: str, num_pages: int) -> tuple[LLM, dict, float]:
    """(the method's engine, its engine options, warm-up seconds): one per method for every
    batch (max_num_seqs = the largest), so a run compiles each method's buckets once."""
    top = max(args.batches)
    engine = dict(model=args.model, dtype=args.dtype, max_num_seqs=top,
                  max_num_batched_tokens=max(args.max_num_batched_tokens, top),
                  num_pages=num_pages, page_size=PAGE_SIZE, max_model_len=args.max_model_len,
                  decode_steps=args.decode_steps, decode_buckets=sorted(set(args.batches)),
                  speculative=speculative_config(method, args.num_draft_tokens),
                  attention_options=args.attention_options) | args.engine  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(**engine)
    return llm, engine, time.perf_counter() - t0


def run_point(llm: LLM, engine: dict, warmup_s: float, method: str, batch: int, prompts,
              sampling) -> tuple[dict, list]:  # fmt: skip
    """One (method, batch) point on the method's engine: the prompts with `batch` in flight."""
    eng = llm.engine
    eng.step_records.clear()
    if eng.adaptive is not None:
        eng.adaptive.log = []
    chained = eng.chained_scans
    t0 = time.perf_counter()
    queue, seqs, live = list(prompts), [], []
    while queue or eng.has_unfinished():
        while queue and len(live) < batch:
            live.append(eng.add_request(queue.pop(0), sampling))
            seqs.append(live[-1])
        eng.step()
        live = [s for s in live if not s.is_finished]
    wall = time.perf_counter() - t0
    errors = [s.error for s in seqs if s.error is not None]
    if errors:
        raise RuntimeError(f"{method} at batch {batch}: {len(errors)} requests failed: {errors[0]}")
    tokens = [list(s.output_token_ids) for s in seqs]
    eng.release(seqs)
    summary = summarize([], eng.step_records)
    row = {
        "method": method, "batch": batch, "requests": len(prompts),
        "output_tokens": sum(map(len, tokens)), "wall_s": round(wall, 3),
        "output_tok_s": round(sum(map(len, tokens)) / wall, 1),
        "steps": len(eng.step_records), "engine_warmup_s": round(warmup_s, 1),
        "compiles_after_warmup": eng.compiles_after_warmup,
        "preemptions": summary["total_preemptions"],
        **{k: summary[k] for k in ("draft_acceptance_rate", "tokens_per_verification",
                                   "acceptance_by_position", "speculative_step_fraction")},
        "speculative": engine["speculative"],
        "steps_by_kind": steps_by_kind(eng.step_records),
        "chained_scans": eng.chained_scans - chained,  # dispatched before the previous was read
    }  # fmt: skip
    if eng.adaptive is not None:
        row["adaptive"] = adaptive_state(eng.adaptive)
        row["adaptive_trace"] = adaptive_trace(eng.adaptive.log)
        eng.adaptive.log = None
    return row, tokens


def steps_by_kind(records) -> dict:
    """Where the wall time went: decode scans (more than one round a call) vs the other steps
    (prefill, mixed prefill + decode, single decode steps), each with its count, seconds (host
    plus the device wait the host saw), the host's part of them and mean rows."""
    scans = [r for r in records if r.decode_steps > 1]
    other = [r for r in records if r.decode_steps <= 1]
    return {kind: {"n": len(rs), "s": round(sum(r.host_ms + r.device_ms for r in rs) / 1e3, 4),
                   "host_s": round(sum(r.host_ms for r in rs) / 1e3, 4),
                   "mean_seqs": round(sum(r.num_seqs for r in rs) / max(len(rs), 1), 1)}
            for kind, rs in (("scan", scans), ("other", other))}  # fmt: skip


def profile_point(llm: LLM, prompts, sampling, batch: int, log_dir: Path, scans: int) -> dict:
    """Trace `scans` decode scans of `batch` of the prompts in flight, from the first scan's end
    (prefill is not in it); the rest runs untraced. Device time per decode round."""
    import jax

    eng = llm.engine
    eng.step_records.clear()
    seqs = [eng.add_request(p, sampling) for p in prompts[:batch]]

    def scans_run() -> int:
        return sum(r.decode_steps > 1 for r in eng.step_records)

    while eng.has_unfinished() and scans_run() < 1:
        eng.step()
    first, start = scans_run(), len(eng.step_records)
    log_dir.mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(log_dir))
    try:
        while eng.has_unfinished() and scans_run() < first + scans:
            eng.step()
        jax.block_until_ready(eng.runner.kv)  # (a chained scan may still be running)
    finally:
        jax.profiler.stop_trace()
    steps = eng.step_records[start:]
    traced = [r for r in steps if r.decode_steps > 1]
    rounds = sum(r.decode_steps for r in traced)
    while eng.has_unfinished():
        eng.step()
    eng.release(seqs)
    summary = summarize_trace(log_dir, top=10)
    out = {"dir": str(log_dir), "scans": len(traced), "rounds": rounds,
           "steps_traced": len(steps)}  # fmt: skip
    if "device_ms" not in summary or not rounds:
        return out | {"error": summary.get("error", "no decode scan ran")}
    per = lambda ms: round(ms / rounds, 4)  # noqa: E731
    return out | {
        "device_ms_per_round": per(summary["device_ms"]),
        "span_ms_per_round": per(summary["span_ms"]),
        "idle_ms_per_round": per(summary["idle_ms"]),
        "overlapped_starts": summary["overlapped_starts"],  # a slow engine's: ~3% (docs)
        "kinds_ms_per_round": {k["name"]: per(k["time_ms"]) for k in summary["kinds"]},
        "top_ops": summary["top_ops"],
        "top_gaps": summary["top_gaps"][:5],  # idle time by the ops either side
    }  # fmt: skip


def adaptive_state(policy) -> dict:
    """Adaptive speculation's view after a point, per decode bucket (rows) and path: its EWMA
    of output tok/s and of seconds a scan (the engine, and so the policy, is the method's for
    every point: later points start from earlier ones' rates)."""
    state: dict = {}
    for (bucket, speculative), rate in sorted(policy.rate.items()):
        path = "speculative" if speculative else "plain"
        state.setdefault(str(bucket), {})[path] = {
            "tok_s": round(rate, 1), "scan_s": round(policy.seconds[bucket, speculative], 5)}  # fmt: skip
    return state


def adaptive_trace(log: list[tuple]) -> dict:
    """The point's scans as adaptive speculation measured them, one list per field: which scan
    of its bucket (dispatch order), the path, its tok/s and ms, and both paths' EWMAs after it
    (a run that speculated where its final rates say plain is faster shows here when and on
    which measurements the policy held speculation the faster path)."""
    r = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {"scan": [e[0] for e in log], "bucket": [e[1] for e in log],
            "speculative": [int(e[2]) for e in log], "tok_s": [r(e[3]) for e in log],
            "ms": [round(1e3 * e[4], 3) for e in log], "spec_ewma": [r(e[5]) for e in log],
            "plain_ewma": [r(e[6]) for e in log]}  # fmt: skip


def divergence(tokens: list[list[int]], base: list[list[int]]) -> dict:
    """How far each request's output agrees with the plain run's: the requests that differ, and
    the index of the first differing token of each (where bf16 rounding flipped a near-tie)."""
    firsts = [next((i for i, (a, b) in enumerate(zip(t, u, strict=False)) if a != b),
                   min(len(t), len(u))) for t, u in zip(tokens, base, strict=True) if t != u]  # fmt: skip
    return {"diverged_requests": len(firsts), "first_divergence": firsts}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
            sub = [r for r in rows if r["workload"] == wl and r["method"] == method]
            ax.plot([r["batch"] for r in sub], [r["speedup"] for r in sub], "o-", label=method)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests in flight)")
        ax.set_ylabel("output tok/s over no speculation")
        ax.set_title(wl)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", nargs="+",
                    default=["none", "ngram", "draft:tiny-draft", "self:2",
                             "eagle:eagle-tiny"])  # fmt: skip
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--waves", type=int, default=2, help="requests per batch slot")
    ap.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="at least this many requests per point (more waves at small batches)",
    )
    ap.add_argument("--workloads", nargs="+", default=["grounded", "open"], choices=KINDS)
    ap.add_argument("--snippet-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-pages", type=int, default=0, help="0: enough that no point preempts")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--attention-options", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine.attention_options for every method (e.g. "
                    "fused_kv_write=false)")  # fmt: skip
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine settings for every method over the script's (e.g. "
                    "compile_workers=1; a dict replaces the engine's default whole)")  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="after each point, trace --profile-scans of its decode scans into DIR")  # fmt: skip
    ap.add_argument("--profile-scans", type=int, default=4)
    args = ap.parse_args(argv)
    for flag in ("attention_options", "engine"):
        bad = [o for o in getattr(args, flag) if "=" not in o]
        if bad:
            ap.error(f"--{flag.replace('_', '-')}: {bad[0]!r} is not KEY=VALUE")
        setattr(args, flag, OmegaConf.to_container(OmegaConf.from_dotlist(getattr(args, flag))))
    if "none" not in args.methods:
        ap.error("--methods must include none (the baseline of every speedup)")
    if args.profile_scans < 1:
        ap.error(f"--profile-scans must be >= 1, got {args.profile_scans}")
    for method in args.methods:  # before any method's process runs for minutes
        try:
            speculative_config(method, args.num_draft_tokens)
        except ValueError as e:
            ap.error(f"--methods: {method!r}: {e}")
    methods = ["none", *[m for m in args.methods if m != "none"]]
    args_json = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"args": args_json, "env": {"XLA_FLAGS": os.environ.get("XLA_FLAGS")}, "rows": []}
    base = {}  # (workload, batch) -> (tokens, output tok/s) of "none"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for method in methods:  # "none" first: every other row's baseline exists when it runs
        # each method in a process of its own (jaxinfer/experiment/isolated.py says why); this
        # one starts no JAX backend, so it holds no GPU memory beside them
        points = in_own_process(method_points, args, method, typed_command())
        result = {**next(points), **result}  # provenance: the first method's process's
        for row, tokens in points:
            wl, batch = row["workload"], row["batch"]
            if method == "none":
                base[wl, batch] = tokens, row["output_tok_s"]
            base_tokens, base_tok_s = base[wl, batch]
            row.update(speedup=round(row["output_tok_s"] / base_tok_s, 3),
                       same_output_as_none=tokens == base_tokens,
                       **divergence(tokens, base_tokens))  # fmt: skip
            result["rows"].append(row)
            args.out.write_text(json.dumps(result, indent=1) + "\n")  # (kept as it goes)
            print(f"{wl:8s} batch {batch:3d} {method:18s} {row['output_tok_s']:9.1f} tok/s "
                  f"x{row['speedup']:.2f}  tau {row['tokens_per_verification']}  "
                  f"same {row['same_output_as_none']}", flush=True)  # fmt: skip
    if args.plot is not None:
        plot(result["rows"], args.plot)


def method_points(args, method: str, command: list[str]):
    """One method's part of the run (`main` runs it in a process of its own): this process's
    provenance (with `command`, the run's), then each (workload, batch) point's (row, tokens) as
    it finishes, on one engine (`build_engine`)."""
    yield provenance(command)
    prompter = LLM(args.model, warmup=False, num_pages=4, max_model_len=48)  # its tokenizer
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                              temperature=args.temperature, seed=0)  # fmt: skip
    waves = {b: max(args.waves, -(-args.min_requests // b)) for b in args.batches}
    points = [(wl, batch, prompts_of(wl, prompter, batch * waves[batch], args.snippet_chars))
              for wl in args.workloads for batch in args.batches]  # fmt: skip
    del prompter
    num_pages = args.num_pages or pages_for(args, max(len(p) for *_, ps in points for p in ps))
    llm, engine, warmup_s = build_engine(args, method, num_pages)
    for wl, batch, prompts in points:
        row, tokens = run_point(llm, engine, warmup_s, method, batch, prompts, sampling)
        row["workload"] = wl
        if args.profile is not None:
            name = f"{method.replace(':', '_').replace('/', '_')}_{wl}_b{batch}"
            row["profile"] = profile_point(llm, prompts, sampling, batch, args.profile / name,
                                           args.profile_scans)  # fmt: skip
        yield row, tokens


if __name__ == "__main__":
    main()
