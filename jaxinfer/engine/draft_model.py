"""A draft model as the proposer: a smaller model with the target's vocabulary drafts γ tokens
greedily from its own paged KV pool, inside the decode scan (no host round trip per round).

The draft's pool has the target's pages (same `num_pages` and `page_size`, its own layers and
heads) and uses the target's page table, so the block manager's pages serve both and a
preemption frees both. Its cache follows the target's tokens:
- every mixed step runs the draft over the step's batch too (`fill`), so a prefill fills the
  draft's pages as it fills the target's;
- a decode-scan round starts from the last token t at position p. The draft's cache holds every
  position before p - 1, and p - 1 too unless the previous round kept all γ drafts (the draft
  never fed its own last draft). So the round feeds (token at p - 1, t) as a ragged batch of two
  tokens per row, then its own drafts one at a time: γ draft passes make d_1 .. d_γ, each the
  draft's argmax. Rejected drafts' K/V is dead by length, as in the target's pool.

Drafts (`engine.speculative.draft_sampling`): "rejection" draws each from the draft's
distribution q through the row's own filters (temperature, top-k, top-p, min-p), keyed by
(seed, position, draft stream), and the verification keeps it with probability min(1, p/q)
(`sampler.rejection_verify`): the output is distributed as plain decoding's. "greedy" drafts the
argmax, which `sampler.accept_drafts` keeps while it equals the target's own sample: the output
is plain decoding's token for token, and a draft survives with the target's probability of the
draft's argmax (less than the rejection rule's at temperature > 0).

Drafts come from the decode scans only (`propose` drafts nothing): a mixed step's drafts would
need the draft run after the sampling of the step before, on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.proposer import Proposer, Round
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import DRAFT_STREAM, draw_from, filtered_probs
from jaxinfer.kv.cache import KVCache, init_kv_cache
from jaxinfer.models.batch import RaggedBatch, rows_batch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_paged
from jaxinfer.models.spec import layer_weight_paths, param_shardings


@dataclass(frozen=True)
class DraftState:
    """Per row: the previous round's fed tokens (its last token, then its drafts) [S, γ + 1],
    and that last token's position [S] (so the token at any later position up to its drafts'
    end is known)."""

    fed: jax.Array
    position: jax.Array


jax.tree_util.register_dataclass(DraftState, data_fields=["fed", "position"], meta_fields=[])


def early_exit_draft(cfg: ModelConfig, params, num_layers: int):
    """(config, params) of the target's first `num_layers` layers with its own final norm and
    head (self-speculative decoding, LayerSkip-style early exit, Elhoushi et al. 2024): the
    arrays are the target's, not copies."""
    plain = cfg.plain().replace(num_layers=num_layers, layer_types=cfg.layer_types[:num_layers],
                                ffn_kinds=cfg.ffn_kinds[:num_layers])  # fmt: skip
    # each linear weight keeps the target's format (the target's recipe may name later layers)
    linear, _ = layer_weight_paths(plain)
    recipe = tuple((path, cfg.weight_format_of(int(path.split(".")[1]), path.split(".", 2)[2]))
                   for path in linear) if cfg.has_formats else ()  # fmt: skip
    draft_cfg = plain.replace(weight_formats=recipe)
    return draft_cfg, {**params, "layers": tuple(params["layers"][:num_layers])}


class DraftModelProposer(Proposer):
    """Drafts of `num_draft_tokens` tokens by the model (`cfg`, `params`), from its own pool."""

    on_device = True

    def __init__(self, cfg: ModelConfig, params, num_draft_tokens: int,
                 rejection: bool = True) -> None:  # fmt: skip
        self.draft_cfg, self.params, self.num_draft_tokens = cfg, params, num_draft_tokens
        self.rejection = rejection

    # Its weights are arguments of the traced steps (`init_pool`), never constants.
    def static_key(self) -> tuple:
        return (self.draft_cfg, self.num_draft_tokens, self.rejection)

    def init_pool(self, target_params, num_pages: int, page_size: int, kv_dtype: str,
                  shardings) -> tuple[dict, KVCache]:  # fmt: skip
        """(its params laid out by their logical axes, its K/V pool of the target's pages)."""
        mesh = shardings.mesh
        params = jax.device_put(self.params, param_shardings(self.draft_cfg, mesh))
        kv = init_kv_cache(self.draft_cfg, num_pages, page_size, kv_dtype, mesh=mesh,
                           rules=shardings.rules)  # fmt: skip
        return params, kv

    def fill(self, draft_params, pool: KVCache, batch: RaggedBatch, hidden, attention) -> KVCache:
        """A mixed step's part: the draft over the step's batch, filling its pool."""
        _, pool = forward_paged(draft_params, self.draft_cfg, batch, pool, attention=attention)
        return pool

    def device_state(self, seqs: list[Sequence], rows: int) -> DraftState:
        fed = np.zeros((rows, self.num_draft_tokens + 1), np.int32)
        position = np.zeros(rows, np.int32)
        for i, seq in enumerate(seqs):  # the token before the last, at its position
            fed[i, 0] = seq.all_token_ids[-2] if seq.num_tokens > 1 else seq.all_token_ids[-1]
            position[i] = max(seq.num_tokens - 2, 0)
        return DraftState(fed, position)

    def draft(self, state: DraftState, rnd: Round, params, kv: KVCache):
        """(drafts [S, γ], new state, kv, q [S, γ, V] or None) after each row's last token.
        q: the distributions the drafts were drawn from (None: greedy drafts)."""
        cfg, gamma, rows = self.draft_cfg, self.num_draft_tokens, rnd.tokens.shape[0]
        positions, sb = rnd.positions, rnd.sampling

        def step(tok, pos, q):  # q tokens per row ([S, q]) ending at pos; -> argmax after them
            nonlocal kv
            batch = rows_batch(tok, pos, rnd.active, rnd.page_ids, q)
            hidden, kv = forward_paged(params, cfg, batch, kv, attention=rnd.attention)
            logits = compute_logits(params, cfg, hidden.reshape(rows, q, -1)[:, -1])
            if not self.rejection or not sb.filtered:  # (all greedy: Proposer.draft)
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
            j = pos[:, -1] - positions  # the draft's index: it is the token at sb.position + j
            row_sb = dataclasses.replace(sb, position=sb.position + j)
            probs = filtered_probs(logits, row_sb)
            return draw_from(probs, row_sb, row_sb.position, DRAFT_STREAM), probs

        d, q = step(*self._catch_up(state, rnd), 2)
        drafts, qs = [d], [q]
        for j in range(1, gamma):
            d, q = step(drafts[-1][:, None], (positions + j)[:, None], 1)
            drafts.append(d)
            qs.append(q)
        drafts = jnp.stack(drafts, axis=1)
        fed = jnp.concatenate([rnd.tokens[:, None], drafts], axis=1)
        q = None if qs[0] is None else jnp.stack(qs, axis=1)
        return drafts, DraftState(fed, positions), kv, q

    def _catch_up(self, state: DraftState, rnd: Round):
        """(tokens, positions) [S, 2] of a round's first draft pass: the token at p - 1 (the
        previous round fed it, or kept it as a draft the draft never fed), then t at p."""
        back = jnp.clip(rnd.positions - 1 - state.position, 0, self.num_draft_tokens)
        prev = jnp.take_along_axis(state.fed, back[:, None], axis=1)[:, 0]
        pos = jnp.maximum(rnd.positions[:, None] - 1 + jnp.arange(2, dtype=jnp.int32), 0)
        return jnp.stack([prev, rnd.tokens], axis=1), pos

    def follow(self, state: DraftState, rnd: Round, params, kv: KVCache):
        """(state, kv) after a plain round (adaptive speculation): `draft`'s first pass alone,
        so the pool holds every position up to p, as after a speculative round."""
        batch = rows_batch(*self._catch_up(state, rnd), rnd.active, rnd.page_ids, 2)
        _, kv = forward_paged(params, self.draft_cfg, batch, kv, attention=rnd.attention)
        return DraftState(state.fed.at[:, 0].set(rnd.tokens), rnd.positions), kv
