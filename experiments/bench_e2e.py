"""End-to-end benchmark of the engine: decode step time against the memory roofline, offline
throughput against Hugging Face transformers, warm-up time and compiles, and a device profile.

    python3 experiments/bench_e2e.py --out experiments/results/h200/e2e_llama3_8b.json
    python experiments/bench_e2e.py --smoke --out /tmp/e2e.json      # CPU, tiny preset, < 60 s

Parts (`--parts`; default all but profile, which `--profile DIR` adds; --smoke: all four, the
transformers part only where torch and transformers are installed):
- transformers: `generate` of an identically shaped LlamaForCausalLM with random weights (torch
  eager, left padding, min_new_tokens = max_new_tokens) at each of --hf-batch-sizes on the first
  --hf-num-requests requests of each --hf-workloads workload (a count per workload with
  WORKLOAD=N); each batch generates its longest output, and tok/s counts the requested outputs.
  It runs first, in a child process that exits before jax touches the GPU, so the two never share
  the GPU's memory or a process's CUDA libraries.
- decode: for each batch x context, the engine's own compiled `decode_loop` (a `lax.scan` of
  `decode_steps` steps, called through its ModelRunner) on a batch whose sequences hold `context`
  tokens of K/V on shuffled pages. See METHODS for what is timed.
- throughput: --num-requests requests per workload (128/128 fixed; ShareGPT-like lognormal
  lengths), all submitted at t=0 to `LLM.generate`; wall time to the last token. The engine's
  max_num_seqs is the largest --batches value.
- profile: a jax.profiler trace of the first engine steps of a 128/128 batch (mixed prefill steps
  and two decode scans), summarised by device op (jaxinfer.metrics.device_trace); with
  --profile-decode BATCH..., traces of decode scans at those batches, each with its step's account
  (`kinds_ms_per_step`: device ms per step in matmuls, attention, the K/V write, other fusions,
  copies, other, and idle), printed as a table.

With --quant FORMAT (a `jaxinfer.quant.WEIGHT_FORMATS` name) that engine stores the layers' linear
weights in FORMAT (`engine.quant.weights`: the preset's random weights drawn plain, then quantized
on the device), so the decode, throughput and profile parts measure the quantized model, and the
decode roofline counts its stored bytes. The transformers part stays the plain baseline (random
weights in --dtype: HF's model is never quantized), so it is left out of the default parts of a
quantized run; asked for by name, it runs unchanged.

ONE engine serves every jaxinfer part. Its bucket lists are the engine's own, trimmed to the shapes
this run can use (token buckets below the one holding max_num_seqs only ever pad a few small steps
and the decode buckets to those of the measured batches), and JAX's persistent compilation cache
(--compile-cache) lets a second process skip the compiles. The JSON is rewritten after every row,
so a run cut short keeps what it finished; a failing row or part is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from jaxinfer.checkpoint import config_to_hf
from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.model_runner import pick_bucket
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.sampler import SamplingBatch
from jaxinfer.metrics import request_rows, summarize
from jaxinfer.metrics.device_trace import summarize_trace
from jaxinfer.metrics.hf_baseline import left_padded_generate
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import param_bytes
from jaxinfer.parallel.sharding import MESH_AXES
from jaxinfer.provenance import provenance, require_gpu
from jaxinfer.quant import WEIGHT_FORMATS
from jaxinfer.workload.generate import synthetic_requests
from jaxinfer.workload.lengths import LengthDist, fixed, lognormal
from jaxinfer.workload.request import WorkloadRequest
from pallas_kernels.paged_attention import resolve_backend

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy on the H200 (torch 4.30 TB/s, anchors.json)
PARTS = ("decode", "throughput", "transformers", "profile")
DEFAULT_MEM_FRACTION = "0.90"  # the KV pool for batch 256 x 2k context is ~65 GiB next to 15 GiB

METHODS = {
    "decode": (
        "step_ms: median over `repeats` of the wall time of `scans` back-to-back calls of the "
        "engine's compiled decode_loop (ModelRunner.run_decode: one lax.scan of decode_steps "
        "steps with sampling and stop masks, K/V cache donated), ended by one block_until_ready, "
        "divided by scans x decode_steps. The host dispatches scan i+1 while scan i runs, as the "
        "engine's async decode does, so the one dispatch per scan the engine pays is included "
        "but hidden behind device time; no per-step dispatch exists. sync_step_ms: one scan "
        "dispatched and waited for (what a synchronous engine pays per scan), / decode_steps. "
        "Every call restarts from the same state: sequences of `context` tokens (K/V pool pages "
        "shuffled, zero-valued), so step j of a scan attends over context + j + 1 tokens. The "
        "decode batch is padded to the engine's bucket (`rows`); greedy sampling. With "
        "--num-draft-tokens G each round is a speculative verification: n-gram drafts of G "
        "tokens, 1 + G rows per sequence (`rows_per_sequence`) scored and sampled; step_ms is "
        "then the cost of one verification round (random weights: the drafts are rarely kept)."
    ),
    "roofline": (
        "roofline_ms = (weight bytes + K/V bytes read per decode step) / 4.3e12 B/s. Weight "
        "bytes: every stored parameter array once (jaxinfer.models.spec.param_bytes of the "
        "served config: a quantized model's values, scales and zero points at their stored "
        "dtypes, 4-bit values two a byte), except that an untied input embedding (always "
        "plain) contributes only the `batch` rows it gathers. K/V bytes: K and V of every "
        "layer for the mean attended length of a scan's steps, context + (decode_steps + 1) / "
        "2, in the pool's dtype (plus per-page scales for FP8 pools). MoE: each MoE layer "
        "counts only its experts that got rows, experts_active_per_layer, measured on the "
        "timed scans (the decode batch is padded to `rows`, but padding routes nowhere). On a "
        "mesh with a model axis of T devices (--mesh model=T) each device reads 1/T of those "
        "bytes at once: the roofline is divided by T. ratio = step_ms / roofline_ms."
    ),
    "throughput": (
        "offline: every request added at t=0 (LLM.generate), greedy, ignore_eos, max_tokens = "
        "the request's output length; wall_s from submission to the last token on the host; "
        "output_tok_s = output tokens / wall_s; total_tok_s = (prompt + output tokens) / wall_s."
    ),
    "transformers": (
        "HF transformers generate (torch eager, the model's default attention implementation, "
        "dynamic KV cache), random weights of the same shape and dtype, left padding, greedy, "
        "min_new_tokens = max_new_tokens = the batch's longest output length (shorter requests "
        "count only their own length: a static batch pads to its longest member). One untimed "
        "2-token generate per batch size first. Timed on the first `num_requests` requests of "
        "the workload (a subset: tok/s, not the time for all of them); best batch size reported, "
        "the sweep inside the row."
    ),
    "warmup": (
        "warmup_s: engine construction start (random weights, KV pool) to every bucket compiled "
        "(Engine.warmup), i.e. ready to serve; compiles_after_warmup: backend compiles counted "
        "process-wide (jaxinfer.engine.compile_counter) after that point, over every later part."
    ),
}


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_len: LengthDist
    output_len: LengthDist
    params: dict  # what to record


def fixed_workload(prompt: int, output: int) -> Workload:
    return Workload(f"fixed_{prompt}_{output}", fixed(prompt), fixed(output),
                    {"prompt_len": prompt, "output_len": output})  # fmt: skip


def sharegpt_like(in_median: float, out_median: float, in_max: int, out_max: int,
                  in_sigma: float = 1.0, out_sigma: float = 0.9, lo: int = 4) -> Workload:  # fmt: skip
    """Lognormal prompt/output lengths with ShareGPT-like medians and long tails (parameters
    chosen to resemble ShareGPT, not fitted to it). `lognormal` takes the unclipped mean, and a
    lognormal's median is exp(mu), so mean = median * exp(sigma^2 / 2)."""

    def dist(median, sigma, hi):
        return lognormal(median * math.exp(sigma**2 / 2), sigma, lo, hi)

    params = {
        "dist": "lognormal, rounded and clipped",
        "prompt_len": {"median": in_median, "sigma": in_sigma, "clip": [lo, in_max]},
        "output_len": {"median": out_median, "sigma": out_sigma, "clip": [lo, out_max]},
    }
    return Workload("sharegpt_like", dist(in_median, in_sigma, in_max),
                    dist(out_median, out_sigma, out_max), params)  # fmt: skip


# Sizes per mode; the corresponding flags override them.
FULL = dict(
    preset="llama3-8b", dtype="bfloat16", batches=[1, 8, 32, 64, 128, 256], contexts=[512, 2048],
    num_requests=1000, max_num_batched_tokens=4096,
    # transformers' throughput still grew from batch 256 to 512 at 128/128
    # (results/h200/e2e_llama3_8b.json); ShareGPT-like batches generate their longest output
    hf_batch_sizes=["256", "512", "1000", "sharegpt=32,64"], hf_num_requests=["1000", "sharegpt=64"],
    hf_workloads="fixed,sharegpt", decode_steps=8, repeats=5, min_timed_s=0.2,
    workloads={"fixed": fixed_workload(128, 128), "sharegpt": sharegpt_like(200, 150, 1024, 1024)},
)  # fmt: skip
SMOKE = dict(
    preset="tiny", dtype="float32", batches=[1, 4], contexts=[16, 40], num_requests=8,
    hf_batch_sizes=[2, 4], hf_num_requests=4, hf_workloads="fixed", max_num_batched_tokens=32,
    decode_steps=4,
    repeats=2, min_timed_s=0.005,
    workloads={"fixed": fixed_workload(16, 8), "sharegpt": sharegpt_like(12, 6, 32, 16)},
)  # fmt: skip


def _option(text: str) -> tuple[str, object]:
    """'key=value' -> (key, value), the value read as YAML (true -> True, 3 -> 3)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=VALUE")
    return key, yaml.safe_load(value)


def _xla_option(text: str) -> tuple[str, str, object]:
    """'kind:name=value' -> (kind, name, value): true/false become bools and integers ints (XLA
    rejects the string 'true' for a bool option); anything else stays a string (as in XLA_FLAGS,
    e.g. the empty list of command-buffer types)."""
    kind, sep, rest = text.partition(":")
    name, eq, value = rest.partition("=")
    if not sep or not eq or not kind or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: want KIND:NAME=VALUE (e.g. "
                                         "decode:xla_gpu_enable_command_buffer=)")  # fmt: skip
    if value.lower() in ("true", "false"):
        return kind, name, value.lower() == "true"
    try:
        return kind, name, int(value)
    except ValueError:
        return kind, name, value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny preset, CPU-sized, < 60 s")
    ap.add_argument("--parts", default=None,
                    help=f"comma-separated subset of {','.join(PARTS)} (default: all but profile; "
                         "--smoke: all, transformers only where torch is installed)")  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="trace a few engine steps into DIR (adds the profile part)")  # fmt: skip
    ap.add_argument("--preset", default=None)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--attention-backend",
        default="auto",
        help="engine attention_backend: auto | xla | pallas | cudnn",
    )
    ap.add_argument("--moe-backend", default="auto", choices=["auto", "xla", "pallas"],
                    help="engine moe_backend: the MoE experts' grouped matmul")  # fmt: skip
    ap.add_argument("--xla-options", nargs="*", default=[], metavar="KIND:NAME=VALUE",
                    type=_xla_option, help="engine.compiler_options, on top of the engine's "
                    "defaults: XLA options of the executables of one kind (all, mixed, decode, "
                    "sample); VALUE 'default' drops the option (XLA's own default), e.g. "
                    "decode:xla_gpu_enable_command_buffer=default")  # fmt: skip
    ap.add_argument("--attention-options", nargs="*", default=[], metavar="KEY=VALUE",
                    type=_option, help="engine.attention_options: the Pallas kernel's tuning "
                    "keywords, e.g. split_decode_rows=false num_stages=3")  # fmt: skip
    ap.add_argument("--kv-dtype", default="auto", help="engine kv_dtype (auto = dtype)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="engine.batch_invariant: each request's logits independent of the "
                         "batch (CPU only so far; docs/batch_invariance.md)")  # fmt: skip
    ap.add_argument("--quant", default="none", choices=["none", *sorted(WEIGHT_FORMATS)],
                    metavar="FORMAT", help="engine.quant.weights: the layers' linear weights in "
                    f"this format (none, {', '.join(sorted(WEIGHT_FORMATS))}); the transformers "
                    "baseline stays plain")  # fmt: skip
    ap.add_argument("--weight-backend", default="auto", choices=["auto", "triton", "xla"],
                    help="the --quant weight-only format's product (jaxinfer.quant.intq): auto "
                         "(the Triton kernel up to 64 tokens), the kernel up to 128 tokens "
                         "(triton), or XLA's; XLA's for larger steps")  # fmt: skip
    ap.add_argument("--num-draft-tokens", type=int, default=0, metavar="G",
                    help="speculative verification cost: n-gram drafts of G tokens, so each decode "
                         "row's step is a verification round of 1 + G rows per sequence")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--workloads", default="fixed,sharegpt", help="subset of fixed,sharegpt")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget per step (default 4096; the xla backend's prefill path "
                         "gathers T x max_model_len keys, so use less with it on the GPU)")  # fmt: skip
    ap.add_argument("--decode-steps", type=int, default=None, help="tokens per decode scan")
    ap.add_argument("--page-size", type=int, default=64,
                    help="64: a 64-key tile of the attention kernel is one TMA copy; decode steps "
                         "were 2-4%% faster than with 16 (results/h200/archive/e2e_llama3_8b_page64.json)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--min-timed-s", type=float, default=None,
                    help="decode: scans per timing grow until one timing lasts this long")  # fmt: skip
    ap.add_argument("--hf-batch-sizes", nargs="+", default=None, metavar="[WORKLOAD=]B[,B...]",
                    help="transformers batch sizes: for every --hf-workloads workload, or "
                         "WORKLOAD=B,B for one (e.g. 256 512 sharegpt=32,64)")  # fmt: skip
    ap.add_argument("--hf-num-requests", nargs="+", default=None, metavar="[WORKLOAD=]N",
                    help="requests timed through transformers: N for every --hf-workloads "
                         "workload, WORKLOAD=N for one (e.g. 512 sharegpt=256); batch sizes "
                         "above a workload's count are not run")  # fmt: skip
    ap.add_argument("--hf-workloads", default=None,
                    help="workloads run through transformers (default: fixed,sharegpt; --smoke: "
                         "fixed)")  # fmt: skip
    ap.add_argument("--hf-timeout-s", type=float, default=1200.0)
    ap.add_argument("--hf-python", default=sys.executable,
                    help="interpreter of the transformers worker (one with torch); default: this "
                         "one. The engine then runs in its own environment: on the H200 image, "
                         "jax in the torch venv picks up that venv's CUDA libraries")  # fmt: skip
    ap.add_argument("--profile-decode-scans", type=int, default=2)
    ap.add_argument("--profile-decode", type=int, nargs="*", default=[], metavar="BATCH",
                    help="also trace decode scans alone at these batch sizes (first --contexts "
                         "value) into DIR/decode_b<BATCH>; needs --profile")  # fmt: skip
    ap.add_argument("--async-schedule", type=int, choices=[0, 1], default=1,
                    help="engine.async_schedule (1: dispatch each mixed step before reading the "
                         "previous one's tokens)")  # fmt: skip
    ap.add_argument("--mesh", nargs="+", default=[], metavar="AXIS=SIZE",
                    help="engine.mesh, e.g. --mesh model=4 or --mesh data=2 model=4 (tensor "
                         "parallel over the model axis; default: one device)")  # fmt: skip
    ap.add_argument("--decode-buckets", type=int, nargs="+", default=None,
                    help="engine decode_buckets: row buckets of the decode scans (default: the "
                         "engine's)")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="engine max_num_seqs (default: the largest --batches)")  # fmt: skip
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pool pages (default: every slot at the longest length)")  # fmt: skip
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=0,
        help="engine.compile_workers: warm-up compile threads (0: one per core)",
    )
    ap.add_argument("--compile-cache", default="/tmp/jaxinfer_jax_cache",
                    help="JAX persistent compilation cache directory ('' disables)")  # fmt: skip
    args = ap.parse_args(argv)
    mesh = {}
    for item in args.mesh:
        axis, _, size = item.partition("=")
        if axis not in MESH_AXES or not size.isdigit() or int(size) < 1 or axis in mesh:
            ap.error(f"--mesh: {item!r}: want AXIS=SIZE, AXIS one of {', '.join(MESH_AXES)}, "
                     "each once")  # fmt: skip
        mesh[axis] = int(size)
    args.mesh = mesh
    defaults = SMOKE if args.smoke else FULL
    for key, value in defaults.items():
        if key != "workloads" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.parts is None:
        args.parts = ",".join(PARTS) if args.smoke else "decode,throughput,transformers"
        if args.smoke and not all(map(importlib.util.find_spec, ("torch", "transformers"))):
            args.parts = args.parts.replace("transformers,", "")
        if args.quant != "none":  # the HF baseline is plain: no quantized counterpart to time
            args.parts = args.parts.replace("transformers,", "").removesuffix(",transformers")
    args.parts = [p for p in args.parts.split(",") if p]
    if args.profile is not None and "profile" not in args.parts:
        args.parts.append("profile")
    if "profile" in args.parts and args.profile is None:
        args.profile = args.out.with_suffix("").with_name(args.out.stem + "_profile")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    keys = {"workloads": [w for w in args.workloads.split(",") if w],
            "hf-workloads": [w for w in args.hf_workloads.split(",") if w]}  # fmt: skip
    for flag, names in keys.items():
        bad = sorted(set(names) - set(defaults["workloads"]))
        if bad:
            ap.error(f"--{flag}: unknown {bad}; choose from {', '.join(defaults['workloads'])}")
    args.workload_defs = [defaults["workloads"][w] for w in keys["workloads"]]
    args.hf_workload_names = [
        defaults["workloads"][w].name for w in keys["hf-workloads"] if w in keys["workloads"]
    ]
    args.profile_workload = defaults["workloads"]["fixed"]  # the 128/128 batch
    wls = defaults["workloads"]
    args.hf_requests = per_workload(ap, "--hf-num-requests", args.hf_num_requests,
                                    defaults["hf_num_requests"], wls, _one_positive_int)  # fmt: skip
    args.hf_batches = per_workload(ap, "--hf-batch-sizes", args.hf_batch_sizes,
                                   defaults["hf_batch_sizes"], wls, _positive_ints)  # fmt: skip
    if "transformers" in args.parts:
        for name in args.hf_workload_names:
            n = min(args.hf_requests[name], args.num_requests)
            if not any(b <= n for b in args.hf_batches[name]):
                ap.error(f"--hf-batch-sizes: none of {args.hf_batches[name]} fits the {n} "
                         f"requests of {name} timed through transformers (--hf-num-requests, "
                         "--num-requests)")  # fmt: skip
    return args


def _positive_ints(text: str) -> list[int]:
    parts = text.split(",")
    if not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(text)
    return [int(x) for x in parts]


def _one_positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise ValueError(text)
    return values[0]


def per_workload(ap, flag: str, values, default, workloads: dict, parse) -> dict:
    """A flag's items ("V" for every workload, "WORKLOAD=V" for one) -> value per workload name.
    Plain items join with commas (`--hf-batch-sizes 256 512` is `256,512`) and apply to every
    workload without an item of its own; with no plain item, the mode's `default` items fill in."""

    def split(items) -> tuple[list[str], dict[str, str]]:
        plain, per = [], {}
        for item in map(str, items if isinstance(items, list) else [items]):
            key, _, text = item.rpartition("=")
            if key and key not in workloads:
                ap.error(f"{flag}: unknown workload {key!r} in {item!r}; choose from "
                         f"{', '.join(workloads)}")  # fmt: skip
            if key:
                per[key] = text
            else:
                plain.append(text)
        return plain, per

    plain, per = split(values)
    if not plain:
        default_plain, default_per = split(default)
        plain, per = default_plain, {**default_per, **per}
    out = {}
    for key, wl in workloads.items():
        text = per.get(key, ",".join(plain))
        try:
            out[wl.name] = parse(text)
        except ValueError:
            ap.error(f"{flag}: {text!r} (for {key}) is not a positive count"
                     f"{' list' if parse is _positive_ints else ''}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Bytes per decode step (the roofline)


def weight_bytes_per_step(cfg: ModelConfig, batch: int, experts_active: float | None = None) -> int:
    """Stored bytes of the params of `cfg` (a quantized config counts its formats' arrays), less
    the rows of an untied input table that a step does not gather (the embedding is never in a
    format: its rows are `param_dtype`) and, in an MoE model, the experts no token was routed to:
    each MoE layer reads `experts_active` (measured) of its experts."""
    n = param_bytes(cfg)
    if not cfg.tie_word_embeddings:  # the input table is gathered; a tied one is read as lm_head
        n -= (cfg.vocab_size - batch) * cfg.hidden_size * cfg.jnp_param_dtype.itemsize
    if cfg.moe is not None and experts_active is not None:
        m = cfg.moe
        per_expert = 3 * cfg.hidden_size * m.expert_size * cfg.jnp_param_dtype.itemsize
        moe_layers = sum(cfg.layer(i).ffn == "moe" for i in range(cfg.num_layers))
        n -= int(moe_layers * (m.num_experts - experts_active) * per_expert)
    return n


def kv_bytes_per_step(cfg: ModelConfig, kv, batch: int, context: int, steps: int) -> float:
    mean_len = context + (steps + 1) / 2
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv.dtype.itemsize
    total = batch * mean_len * per_token
    if getattr(kv, "scales", None) is not None:  # FP8 pages: f32 scales per (page, K/V, kv head)
        total += (
            2
            * cfg.num_layers
            * batch
            * math.ceil(mean_len / kv.page_size)
            * (cfg.num_kv_heads * kv.scales.dtype.itemsize)
        )
    return total


# ---------------------------------------------------------------------------------------------
# Decode rows


def time_decode(llm: LLM, batch: int, context: int, pages: np.ndarray, args) -> dict:
    """One decode row on the engine's runner (see METHODS["decode"])."""
    runner, cfg, k = llm.engine.runner, llm.engine.model_config, args.decode_steps
    need = math.ceil((context + k * runner.num_rows) / runner.config.page_size)
    if batch * need > len(pages):
        raise ValueError(f"{batch} x {need} pages exceed the pool ({len(pages)} usable)")
    rng = np.random.default_rng(batch * 100_003 + context)
    table, state, rows = runner.build_decode(
        rng.integers(0, cfg.vocab_size, batch).tolist(),
        [context] * batch,
        [2**30] * batch,  # never runs out: every row stays live for the whole scan
        [[]] * batch,
        pages[: batch * need].reshape(batch, need).tolist(),
    )
    sb = SamplingBatch.build([SamplingParams()] * batch, list(range(batch)), [context + 1] * batch,
                             rows, put=runner.put)  # fmt: skip

    last = []

    def scans(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            outs, _ = runner.run_decode(table, state, sb, k)
        jax.block_until_ready(outs)
        last[:] = [outs]
        return time.perf_counter() - t0

    scans(1)  # first call of this shape: transfers, autotuning caches
    sync = [scans(1) for _ in range(3)]
    n = max(2, min(200, math.ceil(args.min_timed_s / min(sync))))
    step_s = statistics.median(scans(n) for _ in range(args.repeats)) / (n * k)
    kv_bytes = kv_bytes_per_step(cfg, runner.kv, batch, context, k)
    active = None
    if cfg.moe is not None:  # experts with rows per MoE layer, over the scan's real rows' steps
        active = float(np.mean(jax.device_get(last[0][5][1])))
    weight_bytes = weight_bytes_per_step(cfg, batch, active)
    roofline_s = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S / args.mesh.get("model", 1)
    return {
        "batch": batch,
        "context": context,
        "rows": rows,
        "step_ms": round(step_s * 1e3, 4),
        "roofline_ms": round(roofline_s * 1e3, 4),
        "ratio": round(step_s / roofline_s, 3),
        "sync_step_ms": round(statistics.median(sync) / k * 1e3, 4),
        "tok_s": round(batch / step_s, 1),
        "kv_bytes_per_step": int(kv_bytes),
        "weight_bytes_per_step": int(weight_bytes),
        **({} if active is None else {"experts_active_per_layer": round(active, 2)}),
        "scans": n,
        "decode_steps": k,
        "rows_per_sequence": runner.num_rows,  # 1 + G draft tokens verified per round
    }


# ---------------------------------------------------------------------------------------------
# Throughput rows


def jaxinfer_throughput(llm: LLM, workload: Workload, reqs: list[WorkloadRequest]) -> dict:
    engine = llm.engine
    first_step = len(engine.step_records)
    compiles = compile_count()
    sampling = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()  # (what LLM.generate does, keeping the sequences for their times)
    seqs = [engine.add_request(r.prompt_token_ids, s) for r, s in zip(reqs, sampling, strict=True)]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    wrong = [s.seq_id for s, r in zip(seqs, reqs, strict=True)
             if s.error is not None or len(s.output_token_ids) != r.output_len]  # fmt: skip
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests failed or were cut short, e.g. {wrong[:5]}")
    prompt_toks = sum(len(r.prompt_token_ids) for r in reqs)
    output_toks = sum(r.output_len for r in reqs)
    steps = engine.step_records[first_step:]
    scans = [s for s in steps if s.decode_steps > 1]
    m = summarize(request_rows(seqs), steps, max_num_seqs=engine.config.max_num_seqs)
    engine.release(seqs)
    return {
        "impl": "jaxinfer",
        "workload": workload.name,
        "num_requests": len(reqs),
        "wall_s": round(wall, 3),
        "output_tok_s": round(output_toks / wall, 1),
        "total_tok_s": round((prompt_toks + output_toks) / wall, 1),
        "prompt_tokens": prompt_toks,
        "output_tokens": output_toks,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "steps": {
            "mixed": len(steps) - len(scans),
            "decode_scans": len(scans),
            "mean_seqs_per_step": round(float(np.mean([s.num_seqs for s in steps])), 1),
            "host_fraction": round(sum(s.host_ms for s in steps) / 1e3 / wall, 4),
        },
        "ttft_median_s": m["ttft_median"],
        "tpot_median_s": m["tpot_median"],
        "preemptions": m.get("total_preemptions"),
        "compiles_during_run": compile_count() - compiles,
    }


# ---------------------------------------------------------------------------------------------
# transformers baseline (child process)


def hf_worker(job_path: str, out_path: str) -> None:
    """Child-process entry: time HF generate per job and write the rows (see METHODS)."""
    import torch
    import transformers

    job = json.loads(Path(job_path).read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the tiny random model's denormal activations run ~100x slower on x86
        torch.set_flush_denormal(True)
    dtype = getattr(torch, job["dtype"])
    config = transformers.AutoConfig.for_model(**job["hf_config"])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random init on the device: no 8B host init or copy
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(device).eval()  # a no-op unless from_config ignored the device context
    assert {p.dtype for p in model.parameters()} == {dtype}, "parameters not in the job's dtype"
    model.generation_config.pad_token_id = 0
    if device == "cuda":
        torch.cuda.synchronize()
    init_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], new_tokens: int) -> int:
        rows = left_padded_generate(model, prompts, new_tokens, device)
        generated = len(rows[0])
        assert generated == new_tokens, (generated, new_tokens)
        return generated * len(prompts)

    info = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "init_s": round(init_s, 2),
        "torch_threads": torch.get_num_threads(),
    }
    rows = []
    for wl in job["workloads"]:
        prompts, out_lens = wl["prompts"], wl["output_lens"]
        for b in wl["batch_sizes"]:
            row = {"impl": "transformers", "workload": wl["name"], "batch_size": b,
                   "num_requests": len(prompts)}  # fmt: skip
            try:
                generate(prompts[:b], 2)  # warm-up at this batch size
                t0 = time.perf_counter()
                generated = 0
                for i in range(0, len(prompts), b):
                    generated += generate(prompts[i : i + b], max(out_lens[i : i + b]))
                if device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                useful = sum(out_lens)
                row.update(
                    wall_s=round(wall, 3),
                    output_tok_s=round(useful / wall, 1),
                    total_tok_s=round((useful + sum(map(len, prompts))) / wall, 1),
                    generated_tokens=generated,
                    output_tokens=useful,
                )
            except Exception as e:  # e.g. out of memory at the largest batch: keep the others
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            # after every row: a parent that stops this worker (its timeout) keeps what finished;
            # written aside and renamed, so a stop mid-write leaves the previous rows whole
            tmp = Path(f"{out_path}.tmp")
            tmp.write_text(json.dumps({"info": info, "rows": rows}))
            tmp.replace(out_path)


def run_transformers(cfg: ModelConfig, args, workloads: dict[str, list[WorkloadRequest]]) -> dict:
    job = {
        "hf_config": config_to_hf(cfg, dtype=args.dtype),
        "dtype": args.dtype,
        "workloads": [
            {
                "name": name,
                "prompts": [r.prompt_token_ids for r in reqs[: args.hf_requests[name]]],
                "output_lens": [r.output_len for r in reqs[: args.hf_requests[name]]],
                # a batch larger than the requests timed would repeat a smaller one's run
                "batch_sizes": [
                    b for b in args.hf_batches[name] if b <= min(len(reqs), args.hf_requests[name])
                ],
            }
            for name, reqs in workloads.items()
        ],
    }
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the child imports jax; keep it off the GPU
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp, "job.json"), Path(tmp, "rows.json")
        job_path.write_text(json.dumps(job))
        cmd = [args.hf_python, str(Path(__file__).resolve()), "--hf-worker", job_path, out_path]
        try:
            proc = subprocess.run(list(map(str, cmd)), env=env, timeout=args.hf_timeout_s)
        except subprocess.TimeoutExpired:
            if not out_path.exists():
                raise
            done = json.loads(out_path.read_text())  # the rows finished before the timeout
            finished = {(r["workload"], r["batch_size"]) for r in done["rows"]}
            done["rows"] += [
                {"impl": "transformers", "workload": w["name"], "batch_size": b,
                 "num_requests": len(w["prompts"]),
                 "error": f"not finished within --hf-timeout-s {args.hf_timeout_s:g}"}
                for w in job["workloads"] for b in w["batch_sizes"]
                if (w["name"], b) not in finished
            ]  # fmt: skip
            return done
        if proc.returncode != 0:
            raise RuntimeError(f"transformers worker exited with {proc.returncode} (output above)")
        return json.loads(out_path.read_text())


def best_transformers_rows(result: dict) -> list[dict]:
    """Per workload, the best batch size's row with the whole sweep inside it."""
    rows = []
    for name in dict.fromkeys(r["workload"] for r in result["rows"]):
        sweep = [r for r in result["rows"] if r["workload"] == name]
        ok = [r for r in sweep if "error" not in r]
        best = dict(max(ok, key=lambda r: r["output_tok_s"])) if ok else dict(sweep[0])
        best["note"] = (
            f"timed on the first {best['num_requests']} requests of the workload (tok/s); "
            f"best of batch sizes {[r['batch_size'] for r in sweep]}"
        )
        best["batch_sweep"] = [
            {k: r.get(k) for k in ("batch_size", "output_tok_s", "wall_s", "error") if k in r}
            for r in sweep
        ]
        best.update({f"hf_{k}": v for k, v in result["info"].items()})
        rows.append(best)
    return rows


# ---------------------------------------------------------------------------------------------
# Profile


def profile_engine(llm: LLM, reqs: list[WorkloadRequest], log_dir: Path, decode_scans: int) -> dict:
    """Trace engine steps from admission until `decode_scans` decode scans ran; drain untraced."""
    engine = llm.engine
    for r in reqs:
        engine.add_request(r.prompt_token_ids,
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True))  # fmt: skip
    first = len(engine.step_records)
    options = None
    if hasattr(jax.profiler, "ProfileOptions"):
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # every Python call of the host loop would swamp the trace
    log_dir.mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(log_dir), profiler_options=options)
    try:
        while engine.has_unfinished():
            engine.step()
            if sum(s.decode_steps > 1 for s in engine.step_records[first:]) >= decode_scans:
                break
        jax.block_until_ready(engine.runner.kv)  # a chained scan may still be running
    finally:
        jax.profiler.stop_trace()
    traced = engine.step_records[first:]
    engine.run()
    scans = [s for s in traced if s.decode_steps > 1]
    return {
        "dir": str(log_dir),
        "workload": f"{len(reqs)} requests of {reqs[0].prompt_len} in / {reqs[0].output_len} out",
        "steps_traced": {
            "mixed": len(traced) - len(scans),
            "decode_scans": len(scans),
            "decode_steps_per_scan": scans[0].decode_steps if scans else None,
            "max_seqs": max((s.num_seqs for s in traced), default=0),
        },
        "note": "with async decode the last traced step has dispatched one more scan; the trace "
        "ends after it finished, so device totals may include it",
        **summarize_trace(log_dir),
    }


def profile_decode(llm: LLM, batch: int, context: int, pages: np.ndarray, log_dir: Path,
                   args) -> dict:  # fmt: skip
    """Trace `--profile-decode-scans` back-to-back decode scans of one decode row (as timed)."""
    runner, cfg = llm.engine.runner, llm.engine.model_config
    need = math.ceil((context + args.decode_steps) / runner.config.page_size)
    rng = np.random.default_rng(batch)
    table, state, rows = runner.build_decode(
        rng.integers(0, cfg.vocab_size, batch).tolist(), [context] * batch, [2**30] * batch,
        [[]] * batch, pages[: batch * need].reshape(batch, need).tolist(),
    )  # fmt: skip
    sb = SamplingBatch.build([SamplingParams()] * batch, list(range(batch)), [context + 1] * batch,
                             rows, put=runner.put)  # fmt: skip
    jax.block_until_ready(runner.run_decode(table, state, sb, args.decode_steps))
    n = max(1, args.profile_decode_scans)
    log_dir.mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(log_dir))
    try:
        for _ in range(n):
            outs, _ = runner.run_decode(table, state, sb, args.decode_steps)
        jax.block_until_ready(outs)
    finally:
        jax.profiler.stop_trace()
    summary = summarize_trace(log_dir, top=25)
    if "device_ms" in summary:
        steps = n * args.decode_steps
        summary["device_ms_per_step"] = round(summary["device_ms"] / steps, 4)
        summary["span_ms_per_step"] = round(summary["span_ms"] / steps, 4)
        # the account of a decode step: device ms per step by kind of work, and the idle rest
        summary["kinds_ms_per_step"] = {k["name"]: round(k["time_ms"] / steps, 4)
                                        for k in summary["kinds"]}  # fmt: skip
        summary["kinds_ms_per_step"]["idle"] = round(summary["idle_ms"] / steps, 4)
    return {"batch": batch, "context": context, "rows": rows, "scans": n, **summary}


# ---------------------------------------------------------------------------------------------
# Orchestration


def workload_stats(reqs: list[WorkloadRequest]) -> dict:
    out = {}
    for key, values in (("prompt_len", [r.prompt_len for r in reqs]),
                        ("output_len", [r.output_len for r in reqs])):  # fmt: skip
        a = np.asarray(values)
        out[key] = {"mean": round(float(a.mean()), 1), "median": float(np.median(a)),
                    "p90": float(np.percentile(a, 90)), "max": int(a.max()), "sum": int(a.sum())}  # fmt: skip
    return out


def trimmed_buckets(runner, batches: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token buckets from the one holding max_num_seqs up, decode buckets of measured batches)."""
    s = runner.config
    low = pick_bucket(runner.token_buckets, min(s.max_num_seqs, s.max_step_tokens))
    tokens = tuple(b for b in runner.token_buckets if b >= low)
    seqs = sorted({pick_bucket(runner.seq_buckets, b) for b in batches} | {runner.seq_buckets[-1]})
    return tokens, tuple(seqs)


def print_tables(result: dict, console: Console) -> None:
    weights = result.get("quant", {}).get("weights", "none")
    t = Table(title=f"decode step (ms) vs roofline (weights: {weights})", title_justify="left")
    for col in ("batch", "context", "rows", "step_ms", "sync_step_ms", "roofline_ms", "ratio"):
        t.add_column(col, justify="right")
    for r in result["decode"]:
        cells = [str(r.get(c, "-")) for c in
                 ("batch", "context", "rows", "step_ms", "sync_step_ms", "roofline_ms", "ratio")]  # fmt: skip
        if "error" in r:
            cells[3] = r["error"][:60]
        t.add_row(*cells)
    console.print(t)
    t = Table(title="offline throughput", title_justify="left")
    for col in ("workload", "impl", "requests", "batch", "out tok/s", "total tok/s", "wall_s"):
        t.add_column(col, justify="right")
    for r in result["throughput"]:
        t.add_row(r["workload"], r["impl"], str(r["num_requests"]),
                  str(r.get("batch_size", r.get("max_num_seqs", "-"))),
                  str(r.get("output_tok_s", r.get("error", "-"))), str(r.get("total_tok_s", "-")),
                  str(r.get("wall_s", "-")))  # fmt: skip
    console.print(t)
    for name, x in result.get("speedup_vs_transformers", {}).items():
        console.print(f"speedup vs transformers ({name}, output tok/s): {x}x")
    console.print(f"warmup_s {result.get('warmup_s')}  compiles_after_warmup "
                  f"{result.get('compiles_after_warmup')}")  # fmt: skip
    prof = result.get("profile")
    if prof:
        console.print(f"profile: {prof.get('steps_traced')} device_ms {prof.get('device_ms')} "
                      f"span_ms {prof.get('span_ms')} {prof.get('error', '')}")  # fmt: skip
        for key in ("modules", "top_hlo_categories", "top_ops"):
            for op in prof.get(key, [])[:8]:
                console.print(f"  {key:<18} {op['time_ms']:>10.3f} ms {op['count']:>6}x "
                              f"{op['share'] or 0:.3f}  {op['name'][:70]}")  # fmt: skip
    accounts = [p for p in result.get("profile_decode", []) if "kinds_ms_per_step" in p]
    if accounts:
        t = Table(title="decode step account (device ms per step by kind of work)",
                  title_justify="left")  # fmt: skip
        t.add_column("kind")
        for p in accounts:
            t.add_column(f"batch {p['batch']} x {p['context']}", justify="right")
        kinds = list(dict.fromkeys(k for p in accounts for k in p["kinds_ms_per_step"]))
        for kind in [*kinds, "device", "span"]:
            key = {"device": "device_ms_per_step", "span": "span_ms_per_step"}.get(kind)
            t.add_row(kind, *(str(p[key] if key else p["kinds_ms_per_step"].get(kind, "-"))
                              for p in accounts))  # fmt: skip
        console.print(t)
    for e in result["errors"]:
        console.print(f"error in {e['part']}: {e['error'][:300]}")


def engine_options(args, workloads: dict[str, list[WorkloadRequest]]) -> dict:
    """EngineConfig fields: max_num_seqs = the largest decode batch; max_model_len and the page
    pool fit the longest decode context (+ one scan) and the longest request at every slot."""
    page_size, k = args.page_size, args.decode_steps
    longest = max([c + k * (1 + args.num_draft_tokens) for c in args.contexts] +
                  [r.prompt_len + r.output_len for reqs in workloads.values() for r in reqs])  # fmt: skip
    max_model_len = math.ceil(longest / page_size) * page_size
    max_num_seqs = args.max_num_seqs or max(args.batches)
    options = dict(
        dtype=args.dtype, page_size=page_size, max_num_seqs=max_num_seqs,
        num_pages=args.num_pages or max_num_seqs * (max_model_len // page_size) + 1,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_num_seqs),
        max_model_len=max_model_len, decode_steps=k, chunked_prefill=True, async_decode=True,
        attention_backend=args.attention_backend, compile_workers=args.compile_workers,
        moe_backend=args.moe_backend, async_schedule=bool(args.async_schedule),
        attention_options=dict(args.attention_options),
    )  # fmt: skip
    # the engine's default XLA options with --xla-options on top ("default" drops one: XLA's own),
    # written out so that the results file records them
    compiler = {k: dict(v) for k, v in EngineConfig().compiler_options.items()}
    for kind, name, value in args.xla_options:
        compiler.setdefault(kind, {})[name] = None if value == "default" else value
    options["compiler_options"] = compiler
    if args.kv_dtype != "auto":
        options["kv_dtype"] = args.kv_dtype
    if args.decode_buckets:
        options["decode_buckets"] = list(args.decode_buckets)
    if args.mesh:
        options["mesh"] = dict(args.mesh)
    if args.batch_invariant:  # (absent otherwise: engine options of earlier runs read as before)
        options["batch_invariant"] = True
    if args.quant != "none":  # (absent for plain runs: their engine options read as before)
        options["quant"] = {"weights": args.quant}
    if args.num_draft_tokens:  # decode rows time verification rounds of 1 + G rows per sequence
        options["speculative"] = {"method": "ngram", "num_draft_tokens": args.num_draft_tokens}
    return options


def weight_backend_format(args):
    """The --quant format with its product on --weight-backend (a weight-only format's
    `backend`: jaxinfer.quant.intq.BACKENDS); SystemExit naming the flags for any other."""
    from jaxinfer.quant.intq import BACKENDS

    fmt = WEIGHT_FORMATS.get(args.quant)
    if args.quant.startswith("fp8") or getattr(fmt, "backend", None) not in BACKENDS:
        raise SystemExit(f"--weight-backend {args.weight_backend}: --quant {args.quant} is not a "
                         "weight-only format")  # fmt: skip
    return dataclasses.replace(fmt, backend=args.weight_backend)


def quant_record(args, cfg: ModelConfig) -> dict:
    """The weight format of the run and the stored bytes it implies for the plain preset `cfg`
    (`param_bytes`; the decode rows' roofline reads the served config's, the same number)."""
    from jaxinfer.engine.config import QuantConfig
    from jaxinfer.engine.loading import quantized_config

    served = quantized_config(QuantConfig(weights=args.quant), f"preset:{args.preset}", cfg)
    return {
        "weights": args.quant,
        "backend": args.weight_backend,
        "param_bytes": param_bytes(served),
        "plain_param_bytes": param_bytes(cfg),
        "transformers": f"plain {args.dtype} weights (the HF baseline is never quantized)",
    }


def resolved_backend(llm: LLM) -> str:
    """The attention backend the engine's setting stands for on this device and cache."""
    cfg, pages = (
        llm.engine.model_config,
        llm.engine.runner.kv.pages,
    )  # [L, num_pages, 2, page, Hkv, D]
    q = jax.ShapeDtypeStruct((1, cfg.num_heads, cfg.head_dim), pages.dtype)
    pool = jax.ShapeDtypeStruct((pages.shape[1], *pages.shape[3:]), pages.dtype)
    try:
        return resolve_backend(llm.config.attention_backend, q, pool)
    except TypeError:  # a dispatcher whose `auto` looks at the device only
        return resolve_backend(llm.config.attention_backend)


def build_engine(args, options: dict) -> tuple[LLM, dict]:
    """The one engine, warmed up on trimmed buckets; (llm, warm-up facts)."""
    compiles = compile_count()
    t0 = time.perf_counter()
    llm = LLM(f"preset:{args.preset}", warmup=False, **options)
    runner = llm.engine.runner
    jax.block_until_ready((runner.params, runner.kv))
    init_s = time.perf_counter() - t0
    runner.token_buckets, runner.seq_buckets = trimmed_buckets(runner, args.batches)
    llm.engine.warmup()
    return llm, {
        "warmup_s": round(time.perf_counter() - t0, 2),
        "init_s": round(init_s, 2),
        "compile_s": round(llm.engine.warmup_s, 2),
        **runner.warmup_stats,  # lower_s: Python lowering, overlapped with compiles
        "compiles": compile_count() - compiles,
        "token_buckets": list(runner.token_buckets),
        "decode_buckets": list(runner.seq_buckets),
        "pages_per_seq": runner.config.pages_per_seq,
        "kv_pool_gib": round(sum(x.nbytes for x in jax.tree.leaves(runner.kv)) / 2**30, 2),
        "weights_gib": round(sum(x.nbytes for x in jax.tree.leaves(runner.params)) / 2**30, 2),
    }


def speedups(throughput_rows: list[dict]) -> dict[str, float]:
    """jaxinfer / best transformers output tok/s, per workload measured by both."""
    best = {(r["impl"], r["workload"]): r["output_tok_s"] for r in throughput_rows
            if "output_tok_s" in r}  # fmt: skip
    return {
        name: round(ours / best[("transformers", name)], 2)
        for (impl, name), ours in best.items()
        if impl == "jaxinfer" and ("transformers", name) in best
    }


def cache_entries(path: str) -> int | None:
    """Files in the JAX compilation cache directory `path` (None: no cache). Recorded at the start
    of a run: a warm-up measured over a non-empty cache (a reused directory on a machine whose
    /tmp outlived an earlier run) is not a cold one."""
    if not path:
        return None
    root = Path(path)
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def error_row(e: BaseException, **key) -> dict:
    traceback.print_exc()
    return {**key, "error": f"{type(e).__name__}: {e}"[:1000]}


def main(argv=None) -> dict:
    if argv is None and sys.argv[1:2] == ["--hf-worker"]:
        hf_worker(sys.argv[2], sys.argv[3])
        return {}
    args = parse_args(argv)
    if args.weight_backend != "auto":  # the format's product, for every weight of this process
        WEIGHT_FORMATS[args.quant] = weight_backend_format(args)
    if not args.smoke:  # (asked of a child: this process must not touch the GPU yet)
        require_gpu("bench_e2e.py", "--smoke", ask_a_child=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION)
    cached_at_start = cache_entries(args.compile_cache)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    console = Console(width=150)
    command = [sys.executable, *(sys.argv if argv is None else [__file__, *argv])]
    cfg = preset(args.preset, param_dtype=args.dtype, dtype=args.dtype)
    workloads = {
        wl.name: synthetic_requests(
            args.num_requests, wl.prompt_len, wl.output_len, vocab_size=cfg.vocab_size, seed=0
        )
        for wl in args.workload_defs
    }
    result: dict = {
        "preset": args.preset,
        "dtype": args.dtype,
        "quant": quant_record(args, cfg),
        "parts": args.parts,
        "methods": METHODS,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "workloads": {
            wl.name: {
                **wl.params,
                "num_requests": args.num_requests,
                "realized": workload_stats(workloads[wl.name]),
            }
            for wl in args.workload_defs
        },
        "decode": [],
        "throughput": [],
        "errors": [],
    }

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    def part(name: str, fn) -> None:
        """Run one part; a failure is recorded (the JSON keeps what finished) and the run goes on."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            result["errors"].append({"part": name, **error_row(e)})
        result[f"{name}_part_s"] = round(time.perf_counter() - t0, 1)
        write()

    def transformers() -> None:
        chosen = {name: workloads[name] for name in args.hf_workload_names}
        result["throughput"] += best_transformers_rows(run_transformers(cfg, args, chosen))

    if "transformers" in args.parts:  # before jax initialises the GPU (see the module docstring)
        part("transformers", transformers)
    result = {**provenance(command), **result}  # provenance initialises the jax backend
    options = engine_options(args, workloads)
    result["env"] = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")}
    result["env"]["compile_cache"] = args.compile_cache or None
    result["env"]["compile_cache_entries_at_start"] = cached_at_start
    result["env"]["python"] = sys.executable
    result["env"]["hf_python"] = args.hf_python
    result["engine"] = {"model": f"preset:{args.preset}", **options}
    write()
    if not set(args.parts) - {"transformers"}:
        print_tables(result, console)
        return result

    llm, backend = None, None

    def engine() -> None:
        nonlocal llm, backend
        llm, warmup = build_engine(args, options)
        backend = resolved_backend(llm)
        result["attention_backend"] = {"requested": args.attention_backend, "resolved": backend}
        result["moe_backend"] = {"requested": args.moe_backend,
                                 "resolved": llm.engine.runner.moe_backend}  # fmt: skip
        runner = llm.engine.runner  # the decode scans' XLA options as compiled (graphs or not)
        result["decode_cuda_graphs"] = runner.decode_cuda_graphs
        result["decode_compiler_options"] = runner._compiler_options("decode")
        result["warmup_s"] = warmup.pop("warmup_s")
        result["warmup"] = warmup
        result["compiles_after_warmup"] = llm.engine.compiles_after_warmup
        result["quant"]["served_param_bytes"] = param_bytes(llm.engine.model_config)

    def decode() -> None:
        usable = np.random.default_rng(0).permutation(np.arange(1, options["num_pages"]))
        for context in args.contexts:
            for b in args.batches:
                try:
                    row = time_decode(llm, b, context, usable, args)
                except Exception as e:  # record and go on (e.g. out of memory at one shape)
                    row = error_row(e, batch=b, context=context)
                row["attention_backend"] = backend
                result["decode"].append(row)
                print(json.dumps(row), flush=True)
                write()

    def throughput() -> None:
        for wl in args.workload_defs:
            try:
                row = jaxinfer_throughput(llm, wl, workloads[wl.name])
                row["attention_backend"] = backend
                row["quant"] = args.quant
            except Exception as e:
                row = error_row(
                    e, impl="jaxinfer", workload=wl.name, num_requests=args.num_requests
                )
                result["errors"].append({"part": "throughput", **row})
            result["throughput"].append(row)
            print(json.dumps(row), flush=True)
            write()
        result["speedup_vs_transformers"] = speedups(result["throughput"])

    def profile() -> None:
        wl = args.profile_workload
        reqs = workloads.get(wl.name) or synthetic_requests(
            options["max_num_seqs"], wl.prompt_len, wl.output_len, vocab_size=cfg.vocab_size
        )
        result["profile"] = profile_engine(llm, reqs[: options["max_num_seqs"]], args.profile,
                                           args.profile_decode_scans)  # fmt: skip
        usable = np.random.default_rng(1).permutation(np.arange(1, options["num_pages"]))
        result["profile_decode"] = []
        for b in args.profile_decode:
            try:
                row = profile_decode(llm, b, args.contexts[0], usable, args.profile / f"decode_b{b}",
                                     args)  # fmt: skip
            except Exception as e:
                row = error_row(e, batch=b)
            result["profile_decode"].append(row)
            write()

    part("engine", engine)
    if llm is not None:
        for name, fn in (("decode", decode), ("throughput", throughput), ("profile", profile)):
            if name in args.parts:
                part(name, fn)
                result["compiles_after_warmup"] = llm.engine.compiles_after_warmup
        write()
    print_tables(result, console)
    return result


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)
