"""The Hugging Face `generate` baseline, shared by every comparison against transformers.

torch is imported lazily: it is a test/bench extra, not a dependency of jaxinfer.
"""

from __future__ import annotations


def left_padded_generate(model, prompts: list[list[int]], new_tokens: int,
                         device) -> list[list[int]]:  # fmt: skip
    """Greedy `model.generate` of exactly `new_tokens` tokens for a batch of token-id prompts,
    left-padded to the longest (HF's convention for decoder-only batches); new ids per prompt."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        )  # fmt: skip
    return [row[width:].tolist() for row in out]
