"""The end-to-end benchmark's smoke mode runs on the CPU, writes the documented schema, and its
roofline and trace summary count what they claim to."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import experiment_scripts
import jax
import jax.numpy as jnp
import pytest

from jaxinfer.metrics.device_trace import hlo_category, summarize_trace
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import is_spec, param_specs

HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
TORCH_MISSING = "torch or transformers is missing: install the test extra (make test)"


@pytest.fixture(scope="module")
def bench():
    return experiment_scripts.load("bench_e2e")


def test_smoke_run_writes_schema_with_zero_compiles_after_warmup(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")  # main() only sets a default
    out = tmp_path / "e2e.json"
    argv = ["--smoke", "--out", str(out), "--profile", str(tmp_path / "prof"),
            "--profile-decode", "4"]  # fmt: skip
    argv += ["--compile-cache", ""]  # process-wide: it would outlive this test
    argv += ["--attention-backend", "xla"]  # what auto stands for on a CPU
    # every part by name: the smoke default drops transformers where torch is missing, which
    # would drop its checks below without a word (torch is in the test extra: `make test`)
    argv += ["--parts", "decode,throughput,transformers,profile"]
    bench.main(argv)
    r = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "methods", "engine", "workloads"):
        assert key in r, key
    assert "--smoke" in r["command"]
    assert r["errors"] == [], r["errors"] if HAS_TORCH else (TORCH_MISSING, r["errors"])
    assert r["warmup_s"] > 0 and r["compiles_after_warmup"] == 0
    assert r["env"]["compile_cache_entries_at_start"] is None  # no cache: a cold warm-up

    decode = r["decode"]
    assert {(d["batch"], d["context"]) for d in decode} == {(1, 16), (4, 16), (1, 40), (4, 40)}
    for d in decode:
        assert d["step_ms"] > 0 and d["roofline_ms"] > 0 and d["ratio"] > 0, d
        assert d["attention_backend"] == "xla" and d["rows"] >= d["batch"]

    ours = [t for t in r["throughput"] if t["impl"] == "jaxinfer"]
    assert {t["workload"] for t in ours} == {"fixed_16_8", "sharegpt_like"}
    for t in r["throughput"]:
        assert t["num_requests"] > 0 and t["wall_s"] > 0, t
        assert t["output_tok_s"] > 0 and t["total_tok_s"] > t["output_tok_s"], t
    for t in ours:
        assert t["num_requests"] == 8 and t["compiles_during_run"] == 0
        realized = r["workloads"][t["workload"]]["realized"]
        assert t["output_tokens"] == realized["output_len"]["sum"]
    (hf,) = [t for t in r["throughput"] if t["impl"] == "transformers"]
    assert hf["workload"] == "fixed_16_8" and hf["output_tokens"] == 4 * 8
    assert "first 4 requests" in hf["note"] and len(hf["batch_sweep"]) == 2

    prof = r["profile"]
    assert prof["steps_traced"]["decode_scans"] == 2 and prof["steps_traced"]["mixed"] >= 1
    assert "error" not in prof, prof
    assert prof["device_ms"] > 0 and prof["top_ops"]
    assert {m["name"] for m in prof["modules"]} >= {"jit_decode_loop", "jit_mixed_step"}
    (pd,) = r["profile_decode"]  # one decode row traced: its step account by kind of work
    assert pd["batch"] == 4 and "error" not in pd, pd
    kinds = pd["kinds_ms_per_step"]
    assert kinds["matmul"] > 0 and "idle" in kinds
    busy = sum(v for k, v in kinds.items() if k != "idle")
    assert busy == pytest.approx(pd["device_ms_per_step"], rel=0.01, abs=1e-3)


def test_roofline_reads_weights_once_and_kv_of_the_mean_attended_length(bench):
    cfg = preset("llama3-8b", param_dtype="bfloat16", dtype="bfloat16")
    # 8.03e9 parameters, less the 128256 x 4096 input table (only one row gathered), in bf16.
    assert bench.weight_bytes_per_step(cfg, 1) == 2 * (8_030_261_248 - 128256 * 4096 + 4096)
    kv = SimpleNamespace(dtype=jnp.dtype(jnp.bfloat16), scales=None, page_size=16)
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads, d 128, bf16
    # An 8-step scan from 2048 tokens attends over 2049..2056 keys: 2052.5 on average.
    assert bench.kv_bytes_per_step(cfg, kv, 3, 2048, 8) == 3 * 2052.5 * per_token


def _write_trace(root: Path, events: list[dict]) -> None:
    run = root / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "metadata": {}, "traceEvents": events}, f)


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _kernel(pid, tid, name, ts, dur, hlo_op=None, module=None):
    args = {} if hlo_op is None else {"hlo_op": hlo_op, "hlo_module": module}
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_trace_summary_sums_gpu_stream_kernels_and_skips_derived_lines(tmp_path):
    events = [
        _meta(1, "/host:CPU"), _meta(1, "python", tid=1),
        _meta(2, "/device:GPU:0"), _meta(2, "Stream #7(Compute)", tid=7),
        _meta(2, "XLA Ops", tid=100),
        _kernel(1, 1, "PjitFunction(decode_loop)", 0, 500),  # host: not device time
        _kernel(2, 7, "gemv_kernel", 10, 30, "fusion.1", "jit_decode_loop"),
        _kernel(2, 7, "gemv_kernel", 50, 30, "fusion.12", "jit_decode_loop"),
        _kernel(2, 7, "paged_attn", 90, 15, "custom-call.3", "jit_mixed_step"),
        _kernel(2, 100, "fusion.1", 10, 30, "fusion.1", "jit_decode_loop"),  # derived: a repeat
    ]  # fmt: skip
    _write_trace(tmp_path, events)
    s = summarize_trace(tmp_path)
    assert s["source"] == "gpu_streams" and s["num_events"] == 3
    assert s["device_ms"] == pytest.approx(0.075) and s["span_ms"] == pytest.approx(0.095)
    assert s["top_ops"][0] == {"name": "gemv_kernel", "time_ms": 0.06, "count": 2, "share": 0.8}
    assert [(c["name"], c["count"]) for c in s["top_hlo_categories"]] == [
        ("fusion", 2), ("custom-call", 1)
    ]  # fmt: skip
    assert [m["name"] for m in s["modules"]] == ["jit_decode_loop", "jit_mixed_step"]
    # idle: 10 us between fusion.1 and fusion.12 (40 -> 50), 10 us before custom-call.3 (80 -> 90)
    assert s["idle_ms"] == pytest.approx(0.02) and s["overlapped_starts"] == 0.0
    assert sorted((g["name"], g["count"]) for g in s["top_gaps"]) == [
        ("fusion -> custom-call", 1), ("fusion -> fusion", 1)
    ]  # fmt: skip


def test_kernels_replayed_from_a_command_buffer_are_categorised_by_their_own_name(tmp_path):
    events = [
        _meta(2, "/device:GPU:0"), _meta(2, "Stream #7(Compute)", tid=7),
        _kernel(2, 7, "gemm_fusion_dot_33", 0, 50, "command_buffer.4", "jit_decode_loop"),
        _kernel(2, 7, "loop_add_fusion_12", 53, 2, "command_buffer.4", "jit_decode_loop"),
        _kernel(2, 7, "gemm_fusion_dot_130", 57, 30, "command_buffer.4", "jit_decode_loop"),
    ]  # fmt: skip
    _write_trace(tmp_path, events)
    s = summarize_trace(tmp_path)
    assert [(c["name"], c["count"]) for c in s["top_hlo_categories"]] == [
        ("gemm_fusion_dot", 2), ("loop_add_fusion", 1)
    ]  # fmt: skip
    assert {g["name"] for g in s["top_gaps"]} == {
        "gemm_fusion_dot -> loop_add_fusion", "loop_add_fusion -> gemm_fusion_dot"
    }  # fmt: skip
    assert s["idle_ms"] == pytest.approx(0.005)


def test_idle_gaps_take_the_union_of_overlapping_streams():
    from jaxinfer.metrics.device_trace import idle_gaps

    def ev(ts, dur, op):
        return {"ts": ts, "dur": dur, "args": {"hlo_op": op}}

    # a long kernel on one stream hides a short one on another; the gap is after the long one ends
    events = [ev(0, 100, "gemm.1"), ev(20, 10, "copy.2"), ev(130, 5, "scatter.3"),
              ev(140, 5, "scatter.4"), ev(150, 5, "gemm.5"),
              ev(150, 5, "gemm.6")]  # same start and end on another stream  # fmt: skip
    g = idle_gaps(events)
    assert g["idle_ms"] == pytest.approx(0.04)  # 30 + 5 + 5 us
    assert g["overlapped_starts"] == pytest.approx(2 / 5)  # copy.2 and gemm.6 start in a busy span
    top = {x["name"]: (x["time_ms"], x["count"]) for x in g["top_gaps"]}
    assert top == {"gemm -> scatter": (0.03, 1), "scatter -> scatter": (0.005, 1),
                   "scatter -> gemm": (0.005, 1)}  # fmt: skip


def test_trace_summary_on_cpu_counts_thunks_but_not_enclosing_loops(tmp_path):
    events = [
        _meta(1, "/host:CPU"), _meta(1, "worker", tid=3),
        _kernel(1, 3, "while.85", 0, 100, "while.85", "jit_decode_loop"),
        _kernel(1, 3, "ynn_fusion.2", 10, 40, "ynn_fusion.2", "jit_decode_loop"),
        _kernel(1, 3, "SlinkyThreadPool::Await", 60, 30),  # no hlo_op: not an XLA thunk
    ]  # fmt: skip
    _write_trace(tmp_path, events)
    s = summarize_trace(tmp_path)
    assert s["source"] == "cpu_thunks" and s["device_ms"] == pytest.approx(0.04)
    assert [op["name"] for op in s["top_ops"]] == ["ynn_fusion.2"]


def test_trace_summary_reports_a_missing_trace_instead_of_raising(tmp_path):
    assert "error" in summarize_trace(tmp_path / "nothing_here")
    assert hlo_category("loop_add_fusion_3") == "loop_add_fusion"
    assert hlo_category("gemm_fusion_dot.12.1") == "gemm_fusion_dot"


def test_trace_summary_accounts_device_time_by_kind_of_work(tmp_path):
    from jaxinfer.metrics.device_trace import kind_of

    events = [
        _meta(2, "/device:GPU:0"), _meta(2, "Stream #7(Compute)", tid=7),
        _kernel(2, 7, "gemm_fusion_dot_33", 0, 50, "gemm_fusion_dot.33", "jit_decode_loop"),
        _kernel(2, 7, "nvjet_sm90_tst_128x128", 50, 20, "custom-call.7", "jit_decode_loop"),
        _kernel(2, 7, "body_mosaic_gpu_kernel", 70, 5, "mpmd_map.96", "jit_decode_loop"),
        _kernel(2, 7, "input_scatter_fusion_3", 75, 3, "input_scatter_fusion.3", "jit_decode_loop"),
        _kernel(2, 7, "loop_add_fusion_1", 80, 2, "loop_add_fusion.1", "jit_decode_loop"),
        _kernel(2, 7, "input_multiply_reduce_fusion", 82, 1, "input_multiply_reduce_fusion",
                "jit_decode_loop"),
        _kernel(2, 7, "Memset 0", 90, 1),  # no HLO op: a runtime memset
        _kernel(2, 7, "some_custom_kernel", 95, 4, "custom-call.9", "jit_decode_loop"),
    ]  # fmt: skip
    _write_trace(tmp_path, events)
    kinds = {k["name"]: (k["time_ms"], k["count"]) for k in summarize_trace(tmp_path)["kinds"]}
    assert kinds == {"matmul": (0.07, 2), "attention": (0.005, 1), "kv_write": (0.003, 1),
                     "fusion": (0.003, 2), "copy": (0.001, 1), "other": (0.004, 1)}  # fmt: skip
    # the first matching kind wins: a GEMM fusion is a matmul, a scatter fusion the K/V write
    assert kind_of("gemm_fusion_dot") == "matmul" and kind_of("input_scatter_fusion") == "kv_write"
    assert kind_of("loop_select_fusion") == "fusion" and kind_of("while") == "other"
    assert kind_of("ynn_fusion") == "matmul"  # XLA:CPU runs dots as YNNPACK fusions


def test_quantized_run_measures_against_its_own_stored_bytes(bench):
    plain = preset("llama3-8b", param_dtype="bfloat16", dtype="bfloat16")
    args = bench.parse_args(["--out", "/tmp/x.json", "--quant", "int4_g128_sym"])
    # the transformers baseline is plain: not a default part of a quantized run
    assert args.parts == ["decode", "throughput"]
    assert bench.engine_options(args, {})["quant"] == {"weights": "int4_g128_sym"}
    assert "quant" not in bench.engine_options(bench.parse_args(["--out", "/tmp/x.json"]), {})
    # int4_g128_sym by hand: a layer's linear [*in, *out] (K inputs, N outputs) stores K N / 2
    # bytes of packed values and ceil(K / 128) x N fp32 scales; the rest (embed, lm_head, norms)
    # stays bf16
    specs = param_specs(plain)
    stored = 2 * sum(math.prod(s.shape) for k, v in specs.items() if k != "layers"
                     for s in jax.tree.leaves(v, is_leaf=is_spec))  # fmt: skip
    for spec in jax.tree.leaves(specs["layers"], is_leaf=is_spec):
        k, n = math.prod(spec.shape[: spec.in_dims]), math.prod(spec.shape[spec.in_dims :])
        stored += k * n // 2 + 4 * -(-k // 128) * n if spec.in_dims else 2 * k * n
    record = bench.quant_record(args, plain)
    assert record["weights"] == "int4_g128_sym" and record["param_bytes"] == stored
    assert record["plain_param_bytes"] == 2 * 8_030_261_248
    # the roofline reads those stored bytes, less the input-table rows a step does not gather
    served = plain.replace(weight_format="int4_g128_sym")
    assert bench.weight_bytes_per_step(served, 3) == stored - 2 * (128256 - 3) * 4096


def test_weight_backend_puts_a_weight_only_formats_product_on_a_kernel(bench):
    """--weight-backend picks the weight-only format's product (the A/B of its kernels);
    anything but a weight-only format is refused naming the flags."""
    args = bench.parse_args(
        ["--out", "/tmp/x.json", "--quant", "q4_1", "--weight-backend", "triton"]
    )
    assert bench.weight_backend_format(args).backend == "triton"
    assert bench.weight_backend_format(args).name == "q4_1"
    for quant in ("fp8_block", "none"):
        args = bench.parse_args(
            ["--out", "/tmp/x.json", "--quant", quant, "--weight-backend", "xla"]
        )
        with pytest.raises(SystemExit, match="--weight-backend xla: --quant"):
            bench.weight_backend_format(args)
