"""`jaxinfer` command line.

jaxinfer quickstart [--out runs/quickstart]      greedy generation with a tiny model (CPU or GPU)
jaxinfer generate --model HF_DIR --prompt TEXT   greedy continuation from a real checkpoint
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


def quickstart(args: argparse.Namespace) -> int:
    """Random `tiny` model: ragged prompts, greedy decode through shuffled pages, self-check."""
    cfg = preset(args.preset)
    params = init_params(cfg, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(4, 48, 8)]
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
    metrics = {
        **provenance(),
        "model": args.preset,
        "num_params": num_params(cfg),
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": new_tokens,
        "elapsed_s": round(elapsed, 4),
        "output_tok_s": round(new_tokens / elapsed, 1),
        "paged_vs_full_forward_mismatches": mismatches,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    for prompt, out in list(zip(prompts, outputs, strict=True))[:3]:
        print(f"prompt[{len(prompt)} tokens] ... {prompt[-4:]} -> {out[:12]} ...")
    print(
        f"{len(prompts)} prompts, {new_tokens} tokens in {elapsed:.3f}s "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX LLM inference research")
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quickstart", help="greedy generation with a tiny random model")
    q.add_argument("--preset", default="tiny")
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
