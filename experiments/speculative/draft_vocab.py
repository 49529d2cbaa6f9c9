"""A trained EAGLE head with EAGLE-3's draft vocabulary attached after training: the N most
frequent reply tokens of the replies its run generated (`<run>/generated/train-*.npz`,
`jaxinfer/train/eagle.py`), saved as <run>/head_vocab<N>.safetensors; prints the share of the
held-out reply tokens each vocabulary holds.

    python3 experiments/speculative/draft_vocab.py --run /tmp/eagle --target smollm2 \
        --sizes 8192 16384

(The recipe's `draft_vocab` key trains a head with one; this gives an A/B of the vocabulary
alone on one head.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jaxinfer.engine.eagle import load_head, save_head, top_tokens
from jaxinfer.engine.loading import model_config


def reply_tokens(run: Path, split: str) -> np.ndarray:
    files = sorted((run / "generated").glob(f"{split}-*-*.npz"))
    if not files:
        raise SystemExit(f"--run {run}: no generated/{split}-*.npz (a `data: generated` run's)")
    streams = [np.load(f)["stream"] for f in files]
    return np.concatenate([s[s[:, 1] == 1, 0] for s in streams])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the training run's out_dir")
    ap.add_argument("--target", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    args = ap.parse_args()
    cfg = model_config(args.target)
    head, info = load_head(args.run / "head.safetensors", cfg)
    train, heldout = reply_tokens(args.run, "train"), reply_tokens(args.run, "heldout")
    for n in args.sizes:
        vocab = top_tokens(train, n, cfg.vocab_size)
        coverage = float(np.isin(heldout, vocab).mean())
        out = args.run / f"head_vocab{n}.safetensors"
        meta = {**info, "draft_vocab_attached": dict(size=n, heldout_coverage=round(coverage, 4))}
        save_head(out, head, cfg, meta, draft_vocab=vocab)
        print(f"{out}: {n:,} tokens, {coverage:.2%} of {len(heldout):,} held-out reply tokens")


if __name__ == "__main__":
    main()
