"""EAGLE-style draft head (Li et al. 2024, "EAGLE: speculative sampling requires rethinking
feature uncertainty"): one decoder layer drafts from the target's own features.

The head at position i reads (f_{i-1}, e(t_i)): the target's hidden state one position back and
the embedding of token i, concatenated and projected (`fc`, [2E, E]) into one decoder layer
(attention over the head's own K/V, plus MLP), then the target's final norm and LM head (shared
arrays, not copies). Its output g_i is in the space of f_i, so the next draft step feeds
(g_i, e(d)) in its place.

f is the target's *final-norm output* (the LM head's input): `forward_paged` already returns it,
so the plain step changes nothing (no second output, no extra pass), and it is RMS-normalised
(the residual stream before the norm has outlier channels of large magnitude, a worse input for
a small fc layer). EAGLE's own code feeds Hugging Face's `last_hidden_state`, the same tensor.

Fused features (EAGLE-3, Li et al. 2025): a head saved with `feature_layers` reads, in place of
f, the residual streams after those layers of the target (low, middle and high ones), each
RMS-normalised and concatenated (`dense.tap_features`, [.., n E]), projected by its "fuse"
[n E, E] (`true_features`); the target's forward returns them beside its hidden states
(`forward_paged(taps=...)`), and the pool holds them. Drafts after the first still feed g.

State (`EagleCache`, in the runner's `draft_kv` slot): the head's K/V pool (one layer, the
target's pages and page table, as a draft model's pool) and a feature pool [num_pages,
page_size, E] (n E fused) holding f at every position the target scored. Pages are the
sequences', so both survive decode-scan row reshuffles, preemption (a recompute rewrites them)
and prefix sharing (a cached page was filled from the same tokens).

Invariant: at the start of a round with last token t at p, the head's K/V holds its true-feature
entries (f_{i-1}, t_i) for positions < p0 + 1, where p0 is the previous round's position (or
p - γ - 1 at a scan's entry, rebuilt from the host). A round
1. feeds positions p0 + 1 .. p0 + γ + 1 as one chunk (features f_{p0} .. from the feature pool,
   tokens: the previous round's drafts, with t at p): positions up to p are rewritten with true
   features (the drafting of the previous round had written them with its own g), positions past
   p hold garbage, dead by length (each is written again before any query reads it: a write
   precedes the attention in the same pass);
2. its output at p gives d_1; γ - 1 single-token passes give d_2 .. d_γ;
3. after the target's verification pass, `observe` writes f at p .. p + γ into the pool (rows
   past the accepted ones are dead by length, like their K/V).
A plain round (adaptive speculation: no drafts) runs step 1 alone and records f_p (`follow`,
then `observe`), which keeps the invariant: a plain scan runs step 1 in full once before its
first round (`catch_up`: the scan before it may have been speculative), and each round then for
its one fed token (p0 is the previous round's p), not γ + 1 rows.
Every mixed step writes its rows' f and runs the head over the whole batch (`fill`), so a prefill
fills the head's pages as it fills the target's. Drafts come from the decode scans only
(`propose` drafts nothing in mixed steps, as the draft-model proposer).

Draft vocabulary (EAGLE-3): a head saved with `draft_vocab` (token ids, the most frequent in
the target's replies it was trained on) drafts from those tokens only: its LM head is the
target's for those rows (a copy made once, [E, V_d]), so each draft step reads V_d / V of the
target's LM head and samples over V_d. Verification stays exact: q is zero outside the vocabulary
and the target's residual distribution covers the rest.

Drafts (`engine.speculative.draft_sampling`) are drawn and verified as a draft model's
(`draft_model.py`): "rejection" samples each from the head's filtered distribution q and keeps it
with probability min(1, p/q); "greedy" drafts the argmax, kept while it equals the target's
sample.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.assets import ASSETS
from jaxinfer.engine.draft_model import DraftState
from jaxinfer.engine.proposer import Proposer, Round
from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import DRAFT_STREAM, draw_from, filtered_probs
from jaxinfer.kv.cache import KVCache, init_kv_cache, token_slots
from jaxinfer.models.attention import write_kv_and_attend
from jaxinfer.models.batch import RaggedBatch, rows_batch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, decoder_layer, embed
from jaxinfer.models.layers import linear, rms_norm
from jaxinfer.models.spec import _init_tree, layer_specs
from jaxinfer.quant.format import QuantizedWeight
from pallas_kernels.paged_attention.reference import token_sequences

# the target's arrays the head shares (never copies): its embedding, final norm and LM head
SHARED_KEYS = ("embed", "final_norm", "lm_head")
HEAD_FORMAT = "jaxinfer-eagle-head/1"


@dataclass(frozen=True)
class EagleCache:
    """The head's K/V pool (one layer) and the target's final-normed hidden states by position
    [num_pages, page_size, E], both in the target's page layout."""

    kv: KVCache
    features: jax.Array


jax.tree_util.register_dataclass(EagleCache, data_fields=["kv", "features"], meta_fields=[])


def head_config(target: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The head's decoder layer: one dense layer of the target's attention shape, full attention,
    plain weights; `intermediate_size` None keeps the target's MLP width."""
    return target.plain().replace(
        num_layers=1, layer_types=(), ffn_kinds=(), moe=None, sliding_window=None,
        intermediate_size=intermediate_size or target.intermediate_size,
    )  # fmt: skip


def init_head(target: ModelConfig, key: jax.Array, intermediate_size: int | None = None,
              dtype: str = "float32", feature_layers: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """Random head params {"fc": [2E, E], "layer": the decoder layer's params}, and with
    `feature_layers` (EAGLE-3's fused features) "fuse": [len(feature_layers) E, E]."""
    hcfg = head_config(target, intermediate_size).replace(param_dtype=dtype)
    k_fc, k_layer, k_fuse = jax.random.split(key, 3)
    e = target.hidden_size
    fc = jax.random.normal(k_fc, (2 * e, e), jnp.float32) / np.sqrt(2 * e)
    head = {"fc": fc.astype(dtype), "layer": _init_tree(layer_specs(hcfg, 0), k_layer)}
    if feature_layers:
        n = len(feature_layers) * e
        head["fuse"] = (jax.random.normal(k_fuse, (n, e), jnp.float32) / np.sqrt(n)).astype(dtype)
    return head


def true_features(head: dict, target: ModelConfig, feats: jax.Array) -> jax.Array:
    """The head's feature input [..., E] from the target's own features [..., F]: as they are
    (its final-normed hidden states), or with a "fuse" projection, its tapped layers'
    `tap_features` projected [F, E] (drafts after the first feed the head's own output g)."""
    if "fuse" not in head:
        return feats
    return linear(feats.astype(target.jnp_dtype), head["fuse"].astype(target.jnp_dtype))


def head_forward(head: dict, shared: dict, target: ModelConfig, feats: jax.Array,
                 tokens: jax.Array, positions: jax.Array, attend, carry):  # fmt: skip
    """(g [..., E]: final-normed head output, the LM head's input; carry) of features f [..., E]
    one position back and tokens [...] at `positions`; `attend` as `decoder_layer` takes it."""
    hcfg = head_config(target, head["layer"]["w_down"].shape[0]
                       if "w_down" in head["layer"] else None)  # fmt: skip
    x = jnp.concatenate([feats.astype(target.jnp_dtype), embed(shared, target, tokens)], -1)
    x = linear(x, head["fc"].astype(x.dtype))
    layer = jax.tree.map(lambda w: w.astype(x.dtype), head["layer"])
    x, carry, _ = decoder_layer(hcfg, layer, x, positions, attend, carry, np.int32(0),
                                hcfg.layer(0))  # fmt: skip
    return rms_norm(x, shared["final_norm"], target.rms_norm_eps), carry


def shifted_features(hidden: jax.Array) -> jax.Array:
    """f_{i-1} for every position i of windows [B, L, E] (zeros at position 0): the head's
    feature input, as the engine's pool gives it."""
    return jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)


def write_features(features: jax.Array, batch: RaggedBatch, hidden: jax.Array) -> jax.Array:
    """The pool with each token's final-normed hidden [T, E] at its position (padding tokens
    land on the scratch page)."""
    page, offset = token_slots(batch.page_table, batch.query_start_loc, batch.positions,
                               features.shape[1])  # fmt: skip
    return features.at[page, offset].set(hidden.astype(features.dtype))


def read_features(features: jax.Array, page_ids: jax.Array, seq: jax.Array,
                  positions: jax.Array) -> jax.Array:  # fmt: skip
    """f at `positions` [...] of rows `seq` [...] (zeros at negative positions): [..., E]."""
    ps = features.shape[1]
    block = jnp.clip(positions // ps, 0, page_ids.shape[1] - 1)
    f = features[page_ids[seq, block], jnp.maximum(positions, 0) % ps]
    return jnp.where((positions >= 0)[..., None], f, 0)


def save_head(path: str | Path, head: dict, target: ModelConfig, meta: dict | None = None,
              draft_vocab: np.ndarray | None = None) -> Path:  # fmt: skip
    """The head as one safetensors file (the repo's weight format), its shape in the metadata;
    `draft_vocab` (token ids) as the int32 tensor "draft_vocab"."""
    from safetensors.numpy import save_file

    flat = {k: head[k] for k in ("fc", "fuse") if k in head}
    if draft_vocab is not None:
        flat["draft_vocab"] = check_draft_vocab(draft_vocab, target.vocab_size)
    flat.update({f"layer.{k}": v for k, v in head["layer"].items()})
    tensors = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
    info = {"format": HEAD_FORMAT, "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size, **(meta or {})}  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"eagle": json.dumps(info)})
    return path


def check_draft_vocab(ids, vocab_size: int, what: str = "draft_vocab") -> np.ndarray:
    """`ids` as sorted int32 token ids, or a ValueError naming `what` (empty, repeated, or out of
    0 .. vocab_size - 1)."""
    ids = np.asarray(ids)
    if (ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer)
            or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= vocab_size):  # fmt: skip
        raise ValueError(f"{what} must be distinct token ids in 0 .. {vocab_size - 1}, got "
                         f"{ids.dtype} {list(ids.shape)}")  # fmt: skip
    return np.sort(ids).astype(np.int32)


def top_tokens(tokens: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """The `n` most frequent of `tokens` (ties to the lower id), sorted: a draft vocabulary."""
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[: min(n, vocab_size)]).astype(np.int32)


def load_head(path: str | Path, target: ModelConfig, key: str = "engine.speculative.eagle_head"):
    """(head params, its metadata) saved by `save_head` at `path`, or a shipped head by name
    (`jaxinfer/assets/models/NAME/head.safetensors`: eagle-tiny), checked against the target;
    errors name `key`. A draft vocabulary is the head's "draft_vocab" (int32 ids)."""
    from safetensors import safe_open

    shipped = ASSETS / "models" / str(path) / "head.safetensors"  # e.g. "eagle-tiny"
    path = shipped if "/" not in str(path) and shipped.is_file() else Path(path)
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r} is not a file (train one with `jaxinfer train "
                         "configs/train/eagle-tiny.yaml`, or use 'random')")  # fmt: skip
    with safe_open(str(path), framework="numpy") as f:
        info = json.loads((f.metadata() or {}).get("eagle", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if info.get("format") != HEAD_FORMAT:
        raise ValueError(f"{key}={str(path)!r} is not an EAGLE head saved by jaxinfer")
    for field in ("hidden_size", "vocab_size"):
        if info[field] != getattr(target, field):
            raise ValueError(f"{key}={str(path)!r} was trained for a target of {field}="
                             f"{info[field]}; this model's is {getattr(target, field)}")  # fmt: skip
    head = {k: tensors.pop(k) for k in ("fc", "fuse", "draft_vocab") if k in tensors}
    if "draft_vocab" in head:
        head["draft_vocab"] = check_draft_vocab(head["draft_vocab"], target.vocab_size,
                                                f"{key}={str(path)!r}: its draft_vocab")  # fmt: skip
    head["layer"] = {k.removeprefix("layer."): v for k, v in tensors.items()}
    layers = info.get("feature_layers", [])
    if "fuse" in head:
        if (not layers or head["fuse"].shape[0] != len(layers) * target.hidden_size
                or not all(0 <= i < target.num_layers for i in layers)):  # fmt: skip
            raise ValueError(f"{key}={str(path)!r}: its feature_layers {layers} do not fit its "
                             f"fuse {list(head['fuse'].shape)} on a target of "
                             f"{target.num_layers} layers")  # fmt: skip
    elif layers:
        raise ValueError(f"{key}={str(path)!r} names feature_layers {layers} but has no fuse")
    return head, info


def draft_lm_head(target_params: dict, target: ModelConfig, ids: jax.Array) -> jax.Array:
    """The target's LM head at the token ids `ids` [V_d]: [E, V_d] in the target's dtype (a copy;
    a quantized head is dequantized once)."""
    if target.tie_word_embeddings:
        return target_params["embed"][ids].T.astype(target.jnp_dtype)
    head = target_params["lm_head"]
    if isinstance(head, QuantizedWeight):
        head = head.format.dequantize(head)
    return head[:, ids].astype(target.jnp_dtype)


class EagleProposer(Proposer):
    """Drafts of `num_draft_tokens` tokens by the head `head` over the target `target` (see the
    module docstring), from its pools (`EagleCache`)."""

    on_device = True

    def __init__(self, target: ModelConfig, head: dict, num_draft_tokens: int,
                 rejection: bool = True, feature_layers: tuple[int, ...] = ()) -> None:  # fmt: skip
        head = dict(head)
        vocab = head.pop("draft_vocab", None)
        self.draft_vocab = None if vocab is None else check_draft_vocab(vocab, target.vocab_size)
        self.target, self.head, self.num_draft_tokens = target, head, num_draft_tokens
        self.rejection, self.feature_layers = rejection, tuple(feature_layers)
        self.head_cfg = head_config(target, head["layer"]["w_down"].shape[0])

    # Its weights are arguments of the traced steps (`init_pool`), never constants, so two
    # engines of one configuration (a trained head and a random one, say) share their steps.
    def static_key(self) -> tuple:
        vocab = None if self.draft_vocab is None else len(self.draft_vocab)
        return (self.target, self.head_cfg, self.num_draft_tokens, self.rejection,
                self.feature_layers, vocab)  # fmt: skip

    # -- device state ---------------------------------------------------------------------------
    def init_pool(self, target_params: dict, num_pages: int, page_size: int, kv_dtype: str,
                  shardings) -> tuple[dict, EagleCache]:  # fmt: skip
        """(the head's params on the device with the target's shared arrays (the same buffers:
        no copy), its pools)."""
        dtype = self.target.jnp_dtype
        head = shardings.put(jax.tree.map(lambda w: np.asarray(w).astype(dtype), self.head))
        shared = {k: target_params[k] for k in SHARED_KEYS if k in target_params}
        kv = init_kv_cache(self.head_cfg, num_pages, page_size, kv_dtype, mesh=shardings.mesh,
                           rules=shardings.rules)  # fmt: skip
        width = self.target.hidden_size * max(len(self.feature_layers), 1)
        feats = jnp.zeros((num_pages, page_size, width), dtype)
        params = {"head": head, "shared": shared}
        if self.draft_vocab is not None:
            ids = shardings.put(self.draft_vocab)
            params["vocab"] = {
                "ids": ids,
                "lm_head": draft_lm_head(target_params, self.target, ids),
            }
        return params, EagleCache(kv, shardings.put(feats))

    def device_state(self, seqs: list[Sequence], rows: int) -> DraftState:
        """Per row: p0 = p - γ - 1 (at least -1) and the tokens at p0 .. p0 + γ (p: the last
        token's position), so the first round rewrites the head's K/V at p - γ .. p from the
        feature pool (the previous scan's last drafting left its own features there)."""
        gamma = self.num_draft_tokens
        fed = np.zeros((rows, gamma + 1), np.int32)
        position = np.full(rows, -1, np.int32)
        for i, seq in enumerate(seqs):
            p = seq.num_tokens - 1
            p0 = max(p - gamma - 1, -1)
            toks = seq.all_token_ids[max(p0, 0) : p]
            fed[i, (1 if p0 < 0 else 0) : (1 if p0 < 0 else 0) + len(toks)] = toks
            position[i] = p0
        return DraftState(fed, position)

    # -- device passes --------------------------------------------------------------------------
    def _paged(self, params, cache: EagleCache, batch: RaggedBatch, feats, attention):
        page, offset = token_slots(batch.page_table, batch.query_start_loc, batch.positions,
                                   cache.kv.page_size)  # fmt: skip

        def attend(q, k, v, kv, layer, kind):
            return write_kv_and_attend(q, k, v, kv, layer, batch, page, offset,
                                       attention=attention)  # fmt: skip

        g, kv = head_forward(params["head"], params["shared"], self.target, feats, batch.tokens,
                             batch.positions, attend, cache.kv)  # fmt: skip
        return g, dataclasses.replace(cache, kv=kv)

    def fill(self, params, cache: EagleCache, batch: RaggedBatch, hidden, attention):
        """A mixed step's part: the rows' f into the pool, then the head over the batch (each
        row reads f one position back, from this step's rows or the pool)."""
        features = write_features(cache.features, batch, hidden)
        seq, _ = token_sequences(batch.query_start_loc, batch.tokens.shape[0])
        feats = read_features(features, batch.page_table.page_ids, seq, batch.positions - 1)
        feats = true_features(params["head"], self.target, feats)
        _, cache = self._paged(params, EagleCache(cache.kv, features), batch, feats, attention)
        return cache

    def observe(self, cache: EagleCache, batch: RaggedBatch, hidden) -> EagleCache:
        """After a verification pass: its rows' f into the pool."""
        return dataclasses.replace(cache, features=write_features(cache.features, batch, hidden))

    def draft(self, state: DraftState, rnd: Round, params, cache: EagleCache):
        """(drafts [S, γ], new state, cache, q [S, γ, V] or None) after each row's last token,
        as `DraftModelProposer.draft`."""
        gamma, rows = self.num_draft_tokens, rnd.tokens.shape[0]
        g, live, cache = self._rewrite(state, rnd, params, cache)

        def step(tok, pos, feats, q):  # q tokens per row [S, q] -> (g [S, q, E])
            nonlocal cache
            batch = rows_batch(tok, pos, live, rnd.page_ids, q)
            g, cache = self._paged(params, cache, batch, feats.reshape(rows * q, -1),
                                   rnd.attention)  # fmt: skip
            return g.reshape(rows, q, -1)

        vocab = params.get("vocab")

        def draw(g, k):  # the k-th draft (0-based) from g [S, E]
            if vocab is None:
                logits = compute_logits(params["shared"], self.target, g)
                ids = lambda i: i  # noqa: E731
            else:  # over the draft vocabulary; its index i is token ids[i]
                logits = linear(g, vocab["lm_head"].astype(g.dtype)).astype(jnp.float32)
                ids = lambda i: vocab["ids"][i]  # noqa: E731
            if not self.rejection or not rnd.sampling.filtered:  # (all greedy: Proposer.draft)
                return ids(jnp.argmax(logits, axis=-1)).astype(jnp.int32), None
            row_sb = dataclasses.replace(rnd.sampling, position=rnd.sampling.position + k)
            probs = filtered_probs(logits, row_sb)
            d = ids(draw_from(probs, row_sb, row_sb.position, DRAFT_STREAM)).astype(jnp.int32)
            if vocab is not None:  # q over the whole vocabulary, zero outside the draft's
                probs = jnp.zeros((rows, self.target.vocab_size), probs.dtype).at[
                    :, vocab["ids"]].set(probs)  # fmt: skip
            return d, probs

        d, q = draw(g, 0)
        drafts, qs = [d], [q]
        for k in range(1, gamma):
            g = step(drafts[-1][:, None], (rnd.positions + k)[:, None], g[:, None], 1)[:, 0]
            d, q = draw(g, k)
            drafts.append(d)
            qs.append(q)
        drafts = jnp.stack(drafts, axis=1)
        fed = jnp.concatenate([rnd.tokens[:, None], drafts], axis=1)
        q = None if qs[0] is None else jnp.stack(qs, axis=1)
        return drafts, DraftState(fed, rnd.positions), cache, q

    def _rewrite(self, state: DraftState, rnd: Round, params, cache: EagleCache, w=None):
        """A round's first pass (step 1 of the module docstring): the head over p0 + 1 ..
        p0 + w (default w = γ + 1: whatever the previous round kept), its K/V up to p
        rewritten from the target's features. Returns (g at p [S, E], the rows it ran [S],
        cache)."""
        tokens, positions, page_ids = rnd.tokens, rnd.positions, rnd.page_ids
        gamma, rows = self.num_draft_tokens, tokens.shape[0]
        w = gamma + 1 if w is None else w
        p0 = state.position
        m = positions - p0  # tokens to (re)write up to p: 1 .. γ + 1 on a live row
        live = rnd.active & (m >= 1) & (m <= w)
        j = jnp.arange(w, dtype=jnp.int32)[None, :]
        after = jnp.concatenate([state.fed[:, 1:], state.fed[:, :1]], axis=1)[:, :w]  # p0 + 1 + j
        chunk = jnp.where(j == (m - 1)[:, None], tokens[:, None], after)
        chunk_pos = p0[:, None] + 1 + j
        feats = read_features(cache.features, page_ids, jnp.arange(rows)[:, None], chunk_pos - 1)
        feats = true_features(params["head"], self.target, feats)
        batch = rows_batch(chunk, jnp.maximum(chunk_pos, 0), live, page_ids, w)
        g, cache = self._paged(params, cache, batch, feats.reshape(rows * w, -1), rnd.attention)
        g = g.reshape(rows, w, -1)
        g = jnp.take_along_axis(g, jnp.clip(m - 1, 0, w - 1)[:, None, None], axis=1)[:, 0]
        return g, live, cache

    def follow(self, state: DraftState, rnd: Round, params, cache: EagleCache, w: int = 1):
        """(state, cache) after a plain round (adaptive speculation): `draft`'s first pass
        alone, so the head's K/V holds true-feature entries up to p, and the round's `observe`
        adds f_p. One row (`w`): `catch_up` has rewritten what a speculative round left (its
        drafting's own g past its p), so a round has only its fed token at p0 + 1 = p."""
        _, _, cache = self._rewrite(state, rnd, params, cache, w)
        return DraftState(state.fed.at[:, 0].set(rnd.tokens), rnd.positions), cache

    def catch_up(self, state: DraftState, rnd: Round, params, cache: EagleCache):
        """Before a plain scan's first round `rnd`: its `follow` in full (γ + 1 rows), so that
        round's own `follow` finds p written (nothing to do) and later ones one token each."""
        return self.follow(state, rnd, params, cache, self.num_draft_tokens + 1)
