"""Claim 3: paged attention + continuous batching (jaxinfer) vs `transformers` `generate`, same model,
same offline workload, measured side by side in one process.

    python experiments/vs_transformers/run.py --out experiments/results/cpu/vs_transformers.json
    python experiments/vs_transformers/run.py --config experiments/vs_transformers/h200.yaml \
        --num-requests 128 --prompt-lo 64 --prompt-hi 512 --output-lo 16 --output-hi 192 \
        --hf-batch-sizes 128 --out experiments/results/h200/vs_transformers.json

jaxinfer serves every request at once through its engine; transformers runs `generate` over the
requests in fixed batches (left padding, greedy) at each batch size in --hf-batch-sizes, and its
best batch size is the baseline. EOS is ignored on both sides. With mixed output lengths
(--output-lo/--output-hi) each request wants its own number of tokens: jaxinfer stops each one
there; a `generate` batch runs until its longest request is done, and only each request's own
tokens count (a real request would have stopped at its EOS, and `generate` keeps computing a
finished row until the whole batch is done). Times exclude model loading, jaxinfer's warm-up
compile and one short untimed `generate` call. transformers runs in a child process, after
jaxinfer's run, so the two never share a process's CUDA libraries; JAX keeps half the GPU's memory
(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set) and the child gets the rest.

The model: the shipped reference models or a real checkpoint (`smollm2`, a .gguf file, a HF
directory: same weights on both sides; greedy outputs are compared), or with --config a run
config whose `engine` section names e.g. `preset:llama3-8b`: random weights of that shape on each
side (throughput only; outputs are not compared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from jaxinfer.assets import model_path
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.metrics.hf_baseline import left_padded_generate
from jaxinfer.provenance import provenance

# The engine of the CPU result (experiments/results/cpu/vs_transformers.json).
CPU_ENGINE = dict(
    max_num_seqs=64, max_num_batched_tokens=1024, num_pages=1024, page_size=16, max_model_len=256,
    decode_steps=8,
)  # fmt: skip


def workload(n: int, vocab: int, seed: int, prompt_lo: int, prompt_hi: int):
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_lo, prompt_hi + 1, n)
    return [rng.integers(1, vocab, int(k)).tolist() for k in lens]


def output_lengths(n: int, seed: int, lo: int, hi: int) -> list[int]:
    """Uniform in [lo, hi]; its own generator, so the prompts do not depend on it."""
    return np.random.default_rng([seed, 1]).integers(lo, hi + 1, n).tolist()


def run_jaxinfer(llm: LLM, prompts, output_lens: list[int]) -> dict:
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True) for n in output_lens]
    first = len(llm.engine.step_records)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling)
    elapsed = time.perf_counter() - t0
    # Decode-only steps: wall ms per token step (a decode scan of k tokens counts k), split into
    # the host's own time and its wait for the device.
    decode = [r for r in llm.engine.step_records[first:] if r.is_decode_only]
    token_steps = sum(r.decode_steps for r in decode) or 1
    assert all(o.error is None for o in outs)
    assert [len(o.token_ids) for o in outs] == output_lens
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "impl": "jaxinfer",
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 1),
        "decode_ms_per_token_step": round(
            sum(r.host_ms + r.device_ms for r in decode) / token_steps, 3
        ),
        "decode_host_ms_per_token_step": round(sum(r.host_ms for r in decode) / token_steps, 3),
        "decode_device_wait_ms_per_token_step": round(
            sum(r.device_ms for r in decode) / token_steps, 3
        ),
        "warmup_s": round(llm.engine.warmup_s, 2),
        "compiles_after_warmup": llm.engine.compiles_after_warmup,
        "engine": {k: v for k, v in asdict(llm.config).items() if k != "model"},
        "first_outputs": [o.token_ids for o in outs[:2]],
    }


def load_transformers_model(model: str, dtype: str):
    """(model, device): the reference model's weights, or random weights of a preset's shape."""
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype)
    if model.startswith("preset:"):
        from jaxinfer.checkpoint.hf_saver import config_to_hf
        from jaxinfer.models.presets import preset

        hf_config = transformers.AutoConfig.for_model(
            **config_to_hf(preset(model.removeprefix("preset:")), dtype=dtype)
        )
        with device:  # initialise on the device: an 8B model initialised on the host takes minutes
            net = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    else:
        path = Path(model_path(model))
        if path.suffix == ".gguf":  # transformers dequantizes it (needs `gguf` and `accelerate`)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch_dtype
            )
            # The same tensors in a plain model of the same config. As loaded (transformers
            # 5.17, H200), `generate` took 75 ms a step where a plain model of this shape took
            # 26 ms, with the same 26 ms bare forward: the baseline is transformers at its best.
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            with device:
                net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
            net.load_state_dict(loaded.state_dict())
            del loaded
        else:
            net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    net.to(device=device, dtype=torch_dtype).eval()  # a no-op unless a loader ignored either
    if device.type == "cpu":  # random tiny weights give denormal activations, ~100x slower on x86
        torch.set_flush_denormal(True)
    net.generation_config.pad_token_id = 0
    return net, device


def run_transformers(net, device, prompts, output_lens: list[int], batch_size: int) -> dict:
    import torch

    def generate(batch, new_tokens: int):
        return left_padded_generate(net, batch, new_tokens, device)

    generate(prompts[:batch_size], 4)  # warm-up: kernels and allocator, not a measurement
    t0 = time.perf_counter()
    outs, generated = [], 0
    for i in range(0, len(prompts), batch_size):
        want = output_lens[i : i + batch_size]
        rows = generate(prompts[i : i + batch_size], max(want))
        generated += sum(len(r) for r in rows)
        outs += [r[:n] for r, n in zip(rows, want, strict=True)]
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    return {
        "impl": "transformers",
        "batch_size": batch_size,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 1),
        "generated_tok_s": round(generated / elapsed, 1),  # also the tokens past a request's end
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers_weights(net),
        "first_outputs": outs[:2],
    }


def transformers_weights(net) -> str:
    """The transformers version and how its first linear layer holds its weight: a GGUF file may
    load dequantized (a plain `Linear`) or kept in its blocks (a GGUF module), which computes
    differently."""
    import transformers

    linear = next(m for m in net.modules() if "Linear" in type(m).__name__ or "Gguf" in
                  type(m).__name__)  # fmt: skip
    weight = getattr(linear, "weight", None)
    held = f"{type(linear).__name__}, weight {getattr(weight, 'dtype', None)}"
    return f"transformers {transformers.__version__}: {held}"


def transformers_child(job_file: Path, rows_file: Path) -> None:
    """The child process: the transformers side of `job_file`, a row per batch size in `rows_file`
    as soon as it is measured."""
    job = json.loads(job_file.read_text())
    net, device = load_transformers_model(job["model"], job["dtype"])
    rows = []
    for b in job["batch_sizes"]:
        rows.append(run_transformers(net, device, job["prompts"], job["output_lens"], b))
        rows_file.write_text(json.dumps(rows))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "first_outputs"}), flush=True)


def run_transformers_child(job: dict) -> tuple[list[dict], str | None]:
    """(rows, error): `transformers_child` in a process of its own, which never touches JAX."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, rows_file = Path(tmp, "job.json"), Path(tmp, "rows.json")
        job_file.write_text(json.dumps(job))
        cmd = [sys.executable, __file__, "--transformers-child", str(job_file), str(rows_file)]
        rc = subprocess.run(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}).returncode
        rows = json.loads(rows_file.read_text()) if rows_file.is_file() else []
    return rows, None if rc == 0 else f"the transformers process exited with code {rc}"


def engine_options(args: argparse.Namespace) -> dict:
    """LLM keyword arguments: the CPU result's engine, or the `engine` section of --config."""
    if args.config is None:
        return {"model": args.model, "dtype": "float32", **CPU_ENGINE}
    from jaxinfer.experiment.run import load_run_config

    return asdict(load_run_config(args.config, args.set).engine)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny",
                    help="tiny, smollm2, a .gguf file or a HF directory (without --config)")  # fmt: skip
    ap.add_argument("--config", type=Path, default=None, help="run config: its engine section")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="dotted overrides of --config, e.g. engine.model=preset:tiny")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64, help="every request's output length")
    ap.add_argument("--output-lo", type=int, default=None, help="mixed: uniform in [lo, hi]")
    ap.add_argument("--output-hi", type=int, default=None)
    ap.add_argument("--prompt-lo", type=int, default=32)
    ap.add_argument("--prompt-hi", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if (args.output_lo is None) != (args.output_hi is None):
        ap.error("--output-lo and --output-hi go together")
    command = None if argv is None else [sys.executable, __file__, *argv]

    # Before JAX touches the GPU: leave the transformers process room for its model.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    options = engine_options(args)
    model = options.pop("model")
    llm = LLM(model, **options)
    vocab = min(4096, llm.engine.model_config.vocab_size)
    prompts = workload(args.num_requests, vocab, args.seed, args.prompt_lo, args.prompt_hi)
    if args.output_lo is None:
        output_lens = [args.output_len] * args.num_requests
        output_spec = {"output_len": args.output_len}
    else:
        output_lens = output_lengths(args.num_requests, args.seed, args.output_lo, args.output_hi)
        output_spec = {"output_len_uniform": [args.output_lo, args.output_hi]}
    workload_spec = {
        "num_requests": args.num_requests,
        **output_spec,
        "prompt_len_uniform": [args.prompt_lo, args.prompt_hi],
        "arrival": "all at once",
    }
    head = {**provenance(command), "model": model, "dtype": options["dtype"],
            "same_weights": not model.startswith("preset:"), "workload": workload_spec}  # fmt: skip
    rows = [run_jaxinfer(llm, prompts, output_lens)]
    del llm
    write(args.out, head, rows)  # a run cut short keeps what it measured
    print(json.dumps({k: v for k, v in rows[0].items() if k not in ("first_outputs", "engine")}),
          flush=True)  # fmt: skip

    hf_rows, error = run_transformers_child(dict(
        model=model, dtype=options["dtype"], prompts=prompts, output_lens=output_lens,
        batch_sizes=args.hf_batch_sizes,
    ))  # fmt: skip
    if error is not None:
        head["transformers_error"] = error
    result = write(args.out, head, rows + hf_rows)
    print(json.dumps({k: result.get(k) for k in ("speedup_vs_best_transformers",
                                                 "best_transformers_batch_size")}))  # fmt: skip
    if error is not None:
        raise RuntimeError(error)
    return result


def write(out: Path, head: dict, rows: list[dict]) -> dict:
    """The results file: `head`, the rows, and the comparison once transformers has a row."""
    result = {**head, "rows": rows}
    hf = [r for r in rows if r["impl"] == "transformers"]
    if hf:
        best = max(hf, key=lambda r: r["output_tok_s"])
        result["speedup_vs_best_transformers"] = round(
            rows[0]["output_tok_s"] / best["output_tok_s"], 2
        )
        result["best_transformers_batch_size"] = best["batch_size"]
        # Same weights: greedy outputs should agree; reported, not asserted (near-ties may flip).
        result["greedy_outputs_agree_on_first_two_requests"] = (
            rows[0]["first_outputs"] == best["first_outputs"] if head["same_weights"] else None
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--transformers-child"]:
        transformers_child(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
