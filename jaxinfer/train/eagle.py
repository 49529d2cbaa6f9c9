"""Training an EAGLE draft head (`jaxinfer/engine/eagle.py`) on a frozen target's hidden states.

Self-distillation over offline text (the stdlib corpus's train split, `corpus.py`): each step
runs the frozen target over windows of text for its final-normed hidden states f and its
next-token distributions p, then the head, teacher-forced, reads (f_{i-1} + noise, e(t_i)) at
every position i and is trained on (Li et al. 2024, EAGLE sec. 4.3)
    L = CE(p_i, head logits_i) + feature_weight * SmoothL1(g_i, f_i),
with the target's own distribution (`distill: soft`) or its argmax (`distill: argmax`) as the
label: the drafts are judged against the target's samples, not the text. The feature loss keeps
g in f's space, since the head feeds its own g back when it drafts the second token onwards;
the noise (uniform, +-`feature_noise`) makes it robust to its own errors there.

With `feature_layers` (EAGLE-3's fused features, `engine/eagle.py`) the head reads those
layers' features through its "fuse" projection, and there is no feature loss (its g is in no
target feature's space); the unroll alone teaches the later draft steps to read g.

With `data: generated` (the target's own replies to prompts) the loss and the metric count only
the positions whose next token is a reply's, the positions drafting runs at; the prompts are
context. Held-out metric: top-1 agreement, the share of counted held-out positions where the
head's argmax is the target's (the acceptance of a first greedy draft, teacher-forced). The
head is saved with `eagle.save_head` (safetensors, as the shipped models' weights) and loaded by
`engine.speculative.eagle_head`.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import field
from functools import partial
from pathlib import Path
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import optax
from omegaconf import MISSING, OmegaConf
from pydantic import Field, model_validator

from jaxinfer.config_file import Count, load_config, one_of, schema
from jaxinfer.engine.eagle import (
    SHARED_KEYS,
    head_forward,
    init_head,
    save_head,
    shifted_features,
    top_tokens,
    true_features,
)
from jaxinfer.engine.loading import load_model
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_hidden
from jaxinfer.provenance import provenance
from jaxinfer.train.config import warmup_in_range
from jaxinfer.train.corpus import stdlib_corpus
from jaxinfer.train.data import eval_windows, train_batch

DISTILL = ("soft", "argmax")


@schema("")
class EagleTrainConfig:
    kind: str = "eagle"  # selects this schema in `load_train_config`
    name: str = MISSING
    target: str = MISSING  # the target model, as `engine.model` names it (tiny, smollm2, ...)
    target_dtype: str = "float32"
    out_dir: str = "runs/train/${name}"
    head: str = "${out_dir}/head.safetensors"  # the head file `engine.speculative.eagle_head` loads
    intermediate_size: Count | None = None  # the head's MLP width (None: the target's)
    # of the saved head (trained in fp32; bfloat16 halves the file)
    head_dtype: Annotated[str, one_of("float32", "bfloat16")] = "float32"
    heldout_fraction: float = 0.05
    # stdlib modules left out of the training text (e.g. the ones experiments/speculative/run.py
    # builds its prompts from, so its measurement is on text the head never saw)
    exclude_modules: list[str] = field(default_factory=list)
    max_files: int | None = None  # only the first train files (tests; None: all)
    seq_len: Count = 256
    batch_size: Count = 8
    steps: Count = 500
    lr: Annotated[float, Field(gt=0)] = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    distill: Annotated[str, one_of(*DISTILL)] = "soft"
    feature_weight: Annotated[float, Field(ge=0)] = 1.0
    feature_noise: Annotated[float, Field(ge=0)] = 0.0
    eval_every: Count = 100
    eval_windows: Count = 16
    seed: int = 0
    # The text: "text", the split's files as they are; "generated", the target's own replies to
    # `prompts` prompts (`workload.code_prompts`, every kind in turn, on pieces of
    # `snippet_chars` characters of the split's files; `heldout_prompts` for the held-out
    # windows), `reply_tokens` each, kept in <out_dir>/generated/ for the next run.
    data: Annotated[str, one_of("text", "generated")] = "text"
    prompts: Count = 512
    heldout_prompts: Count = 16
    snippet_chars: Count = 400
    reply_tokens: Count = 192
    # sequences the target generates at once (a GPU's decode pays up to a few hundred); each
    # has 32 pages of 16 tokens (SmolLM2 in bf16: 12 MB of K/V)
    reply_batch: Count = 64
    # replies made and saved at a time (a run cut short keeps its finished chunks)
    reply_chunk: Count = 4096
    # The replies are sampled at this temperature (0: greedy; a small model's greedy replies
    # loop, and the head then learns the loops, experiments/results/cpu/eagle_smollm2_train.json)
    reply_temperature: Annotated[float, Field(ge=0)] = 0.0
    # Each reply is cut where it starts to repeat itself: before the first `cut_repeats`-gram
    # that already occurred in it (None: kept whole). A cut reply gets no EOS.
    cut_repeats: Count | None = None
    # The target goes on past its end of turn to `reply_tokens` (ignore_eos), and what it writes
    # there is reply text too: a benchmark that decodes fixed lengths (the speculative one's
    # 256 tokens) drafts there, where a head trained on replies that stop never read (SmolLM2,
    # chat, batch 1: tau 1.54 after the end against 2.88 before it; trained past it, 2.40 and
    # 3.04: experiments/results/cpu/speculative_end_of_turn*.json).
    reply_past_end: bool = False
    # Training-time test (Li et al. 2025, EAGLE-3): `unroll` draft steps, step s fed
    # the head's own outputs of step s - 1 as its features, as drafting does; step s's loss
    # weighs unroll_decay^(s-1).
    unroll: Count = 1
    unroll_decay: Annotated[float, Field(gt=0)] = 0.8
    # EAGLE-3's fused features: the head reads these layers' residual streams (each RMS-
    # normalised, concatenated, projected by its "fuse" [n E, E]) instead of the final hidden
    # states; [] keeps those. Its own output g is then in no target feature's space: no feature
    # loss (feature_weight 0), the unroll teaches the later draft steps to read g.
    feature_layers: list[int] = field(default_factory=list)
    # EAGLE-3's draft vocabulary: the head drafts from this many tokens only, the most frequent
    # in the training text (its reply tokens with data "generated"), saved with it (None: the
    # target's whole vocabulary)
    draft_vocab: Count | None = None

    _warmup = model_validator(mode="after")(warmup_in_range)

    @model_validator(mode="after")
    def _fused_features(self):
        if self.feature_layers and self.feature_weight:
            raise ValueError(f"feature_layers={self.feature_layers} needs feature_weight=0 (got "
                             f"{self.feature_weight}): a fused head's output has no target "
                             "feature to regress to")  # fmt: skip
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(
                i < 0 for i in self.feature_layers):  # fmt: skip
            raise ValueError(f"feature_layers={self.feature_layers}: distinct layer indices "
                             ">= 0")  # fmt: skip
        return self


def is_eagle_config(path: str | Path | None, overrides=()) -> bool:
    """Whether a train config (file + overrides) asks for `kind: eagle`."""
    kinds = [o.split("=", 1)[1] for o in overrides if o.startswith("kind=")]
    if kinds:
        return kinds[-1] == "eagle"
    return path is not None and OmegaConf.load(path).get("kind") == "eagle"


def load_eagle_config(path: str | Path | None, overrides=()) -> EagleTrainConfig:
    """Schema <- YAML <- `key=value` overrides; errors name the offending key."""
    return load_config(EagleTrainConfig, path, overrides, what="train")


def split_texts(tc: EagleTrainConfig, split: str) -> list[str]:
    """The texts of the split's files (less `exclude_modules`; `max_files` of the train split)."""
    corpus = stdlib_corpus(heldout_fraction=tc.heldout_fraction)
    files = corpus.train if split == "train" else corpus.heldout
    skip = {m.replace(".", "/") for m in tc.exclude_modules}
    files = [f for f in files if f.with_suffix("").as_posix() not in skip
             and f.parent.as_posix() not in skip]  # fmt: skip
    if split == "train" and tc.max_files is not None:
        files = files[: tc.max_files]
    return [(corpus.root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def text_stream(tokenizer, tc: EagleTrainConfig, eos: int, split: str) -> np.ndarray:
    """The split's files as one int32 token stream of the target's tokenizer, EOS between."""
    parts = []
    for enc in tokenizer.encode_batch(split_texts(tc, split)):
        parts += [np.asarray(enc.ids, np.int32), np.asarray([eos], np.int32)]
    return np.concatenate(parts)


def chain_attention(q: jax.Array, ks: list[jax.Array], vs: list[jax.Array]) -> jax.Array:
    """Attention of draft step s = len(ks) over windows, as drafting sees its cache: the query
    at position i reads step 1's (true-feature) keys at positions <= i - s + 1 and step r's key
    at position i - s + r for r = 2..s (the chain of drafts since the round's last true
    feature). q [B, L, Hq, D], ks / vs: s arrays [B, L, Hkv, D], step 1 first; softmax in fp32.
    With one step it is causal attention."""
    s = len(ks)
    b, n, hq, d = q.shape
    hkv = ks[0].shape[2]
    qg = q.reshape(b, n, hkv, hq // hkv, d).astype(jnp.float32) * d**-0.5
    i = jnp.arange(n)
    main = jnp.einsum("bqhgd,bkhd->bhgqk", qg, ks[0].astype(jnp.float32))
    scores = [jnp.where(i[None, :] <= i[:, None] - (s - 1), main, -jnp.inf)]
    chain_v = []
    for r in range(2, s + 1):
        back = s - r  # step r's key sits `back` positions before the query
        k_r, v_r = (jnp.roll(a, back, axis=1).astype(jnp.float32) for a in (ks[r - 1], vs[r - 1]))
        sc = jnp.einsum("bqhgd,bqhd->bhgq", qg, k_r)
        scores.append(jnp.where(i >= back, sc, -jnp.inf)[..., None])
        chain_v.append(v_r)
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., :n], vs[0].astype(jnp.float32))
    for r, v_r in enumerate(chain_v):
        out = out + jnp.einsum("bhgq,bqhd->bqhgd", probs[..., n + r], v_r)
    return out.reshape(b, n, hq, d).astype(q.dtype)


def head_forward_unrolled(head, shared, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array,
                          steps: int, noise: jax.Array | None = None) -> list[jax.Array]:  # fmt: skip
    """[g of draft step 1 .. steps], each [B, L, E]: step 1 reads the target's f one position
    back (plus `noise`; `hidden` [B, L, F]: a fused head's tapped features, `true_features`),
    step s > 1 the head's own step s - 1 output one position back, and
    attends as `chain_attention` says. g_s at i drafts token i + 1 after s - 1 drafts."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    feats = true_features(head, cfg, shifted_features(hidden) + (0 if noise is None else noise))
    gs, kvs = [], ()
    for _ in range(steps):

        def attend(q, k, v, carry, layer, kind):
            ks, vs = [*(c[0] for c in carry), k], [*(c[1] for c in carry), v]
            return chain_attention(q, ks, vs), (*carry, (k, v))

        g, kvs = head_forward(head, shared, cfg, feats, tokens, positions, attend, kvs)
        gs.append(g)
        feats = shifted_features(g)
    return gs


def head_loss(head, shared, cfg: ModelConfig, hidden, target_logits, tokens, key, *,
              distill: str, feature_weight: float, feature_noise: float, unroll: int = 1,
              unroll_decay: float = 1.0, weights=None):  # fmt: skip
    """(loss, top-1 agreement per draft step [unroll]) of the head on windows: tokens [B, L],
    the frozen target's f [B, L, E] and logits [B, L, V]. Step s counts positions i >= s - 1
    (a chain that starts at or after the window's first token) whose `weights` [B, L] (None:
    all 1) is 1: the positions whose next token the drafts are judged on."""
    noise = None
    if feature_noise:
        noise = jax.random.uniform(key, hidden.shape, hidden.dtype, -1, 1) * feature_noise
    gs = head_forward_unrolled(head, shared, cfg, hidden, tokens, unroll, noise)
    labels = jnp.argmax(target_logits, -1)
    soft = jax.nn.softmax(target_logits) if distill == "soft" else None
    loss, agree, total = 0.0, [], 0.0
    for s, g in enumerate(gs):
        logits = compute_logits(shared, cfg, g)
        if soft is not None:
            ce = optax.softmax_cross_entropy(logits, soft)
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        valid = jnp.broadcast_to(jnp.arange(tokens.shape[1]) >= s, ce.shape)
        if weights is not None:
            valid = valid * weights
        w = unroll_decay**s
        # (a batch of windows inside prompts has no valid position: its term is 0, not NaN)
        n = jnp.maximum(jnp.sum(valid), 1)
        loss, total = loss + w * jnp.sum(ce * valid) / n, total + w
        agree.append(jnp.sum((jnp.argmax(logits, -1) == labels) * valid) / n)
    if "fuse" in head:  # (a fused head's g has no target feature to regress to)
        return loss / total, jnp.stack(agree)
    feature = optax.huber_loss(gs[0].astype(jnp.float32), hidden.astype(jnp.float32)).mean()
    return loss / total + feature_weight * feature, jnp.stack(agree)


def _target_pass(target_params, cfg, tokens, taps: tuple[int, ...] = ()):
    """(the head's features: the final hidden states, or the `taps` layers' fused ones; the
    target's logits)."""
    if not taps:
        hidden = forward_hidden(target_params, cfg, tokens)
        return hidden, compute_logits(target_params, cfg, hidden)
    hidden, feats = forward_hidden(target_params, cfg, tokens, taps)
    return feats, compute_logits(target_params, cfg, hidden)


LOSS_OPTIONS = ("distill", "feature_weight", "feature_noise", "unroll", "unroll_decay")


@partial(jax.jit, static_argnames=("cfg", "tx", "taps", *LOSS_OPTIONS), donate_argnums=(0, 1))
def train_step(head, opt_state, target_params, tokens, weights, key, *, cfg, tx, taps=(),
               **loss_options):  # fmt: skip
    hidden, target_logits = _target_pass(target_params, cfg, tokens, taps)  # frozen: no gradient
    shared = {k: target_params[k] for k in SHARED_KEYS if k in target_params}

    def loss_fn(h):
        return head_loss(h, shared, cfg, hidden, target_logits, tokens, key, weights=weights,
                         **loss_options)  # fmt: skip

    (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(head)
    updates, opt_state = tx.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, loss, agree


@partial(jax.jit, static_argnames=("cfg", "distill", "unroll", "unroll_decay", "taps"))
def eval_step(head, target_params, tokens, weights, *, cfg, distill, unroll, unroll_decay,
              taps=()):  # fmt: skip
    hidden, target_logits = _target_pass(target_params, cfg, tokens, taps)
    shared = {k: target_params[k] for k in SHARED_KEYS if k in target_params}
    return head_loss(head, shared, cfg, hidden, target_logits, tokens, None, distill=distill,
                     feature_weight=1.0, feature_noise=0.0, unroll=unroll,
                     unroll_decay=unroll_decay, weights=weights)  # fmt: skip


def window_weights(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, L], loss weights [B, L] fp32) of windows of a stream: a text stream's
    [B, L] (every position counts) or a generated one's [B, L, 2] of (token, is-reply), where
    position i counts when token i + 1 is a reply's (the window's last position does not)."""
    if windows.ndim == 2:
        return windows, np.ones(windows.shape, np.float32)
    weights = np.zeros(windows.shape[:2], np.float32)
    weights[:, :-1] = windows[:, 1:, 1]
    return windows[..., 0], weights


def expected_tokens(agreement) -> float:
    """Tokens a greedy verification yields on average with the drafts of these per-step
    agreements (step s's given every earlier draft kept): 1 + a1 + a1 a2 + ..."""
    return float(1 + np.sum(np.cumprod(np.asarray(agreement, np.float64))))


def cut_at_repeat(reply: np.ndarray, n: int) -> tuple[np.ndarray, bool]:
    """(the reply up to where it starts to repeat itself, whether it was cut): cut before the
    first n-gram that already occurred earlier in it (that n-gram's second start)."""
    seen = set()
    for i in range(len(reply) - n + 1):
        gram = tuple(reply[i : i + n].tolist())
        if gram in seen:
            return reply[:i], True
        seen.add(gram)
    return reply, False


def lookup_share(reply: np.ndarray, n: int = 3) -> tuple[int, int]:
    """(tokens a lookup of the reply's own past predicts, tokens): token i counts when the n
    tokens before it occurred earlier in the reply followed by token i (a looping reply's
    tokens nearly all do; drafting learns such loops cheaply)."""
    nexts: dict[tuple, set] = {}
    hits = 0
    toks = reply.tolist()
    for i in range(n, len(toks)):
        gram = tuple(toks[i - n : i])
        hits += toks[i] in nexts.get(gram, ())
        nexts.setdefault(gram, set()).add(toks[i])
    return hits, len(toks)


def generated_streams(tc: EagleTrainConfig, eos: int, log=print):
    """(train, held-out, stats): streams of the target's own replies (prompt, reply, EOS each;
    see `EagleTrainConfig.data`), each int32 [N, 2]: the token and whether it is a reply's
    (its reply tokens and EOS: 1, its prompt: 0); stats per split: replies, reply tokens, the
    replies cut (`cut_repeats`) and the share of reply tokens a lookup predicts
    (`lookup_share`). Made `reply_chunk` prompts at a time, each chunk kept in
    <out_dir>/generated/<split>-<start>-<stop>.npz and reused by a run with the same settings:
    a run cut short keeps its finished chunks, and one with more `prompts` makes only the rest
    (prompt i and its seed do not depend on `prompts`)."""
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.workload.code_prompts import KINDS, prompt_text, snippets

    key = json.dumps(dict(target=tc.target, dtype=tc.target_dtype, max_files=tc.max_files,
                          heldout_fraction=tc.heldout_fraction, snippet_chars=tc.snippet_chars, reply_tokens=tc.reply_tokens,
                          exclude=sorted(tc.exclude_modules), temperature=tc.reply_temperature,
                          cut_repeats=tc.cut_repeats, past_end=tc.reply_past_end, seed=tc.seed,
                          layout="token,is_reply"))  # fmt: skip
    llm = None

    def chunk(split: str, pieces: list[str], start: int, stop: int) -> dict:
        nonlocal llm
        path = Path(tc.out_dir) / "generated" / f"{split}-{start}-{stop}.npz"
        if path.is_file():
            saved = np.load(path)
            if str(saved["key"]) == key:
                return {k: saved[k] for k in ("stream", "cut", "hits", "total")}
        if llm is None:
            llm = LLM(tc.target, dtype=tc.target_dtype, max_num_seqs=tc.reply_batch,
                      max_num_batched_tokens=16 * tc.reply_batch, max_model_len=1024,
                      num_pages=32 * tc.reply_batch, page_size=16, warmup=False)  # fmt: skip
        kinds = KINDS if llm.chat_template is not None else tuple(k for k in KINDS if k != "chat")
        prompts = [prompt_text(kinds[i % len(kinds)], pieces[i], i // len(kinds),
                               llm.render_chat) for i in range(start, stop)]  # fmt: skip
        sampling = [SamplingParams(max_tokens=tc.reply_tokens, temperature=tc.reply_temperature,
                                   ignore_eos=tc.reply_past_end,
                                   seed=zlib.crc32(f"{tc.seed} {split} {i}".encode()))
                    for i in range(start, stop)]  # fmt: skip
        outs = llm.generate(prompts, sampling)
        failed = [o.error for o in outs if o.error is not None]
        if failed:  # (e.g. a prompt + reply past the engine's max_model_len)
            raise ValueError(f"train config: {len(failed)} of the {split} prompts failed "
                             f"(snippet_chars={tc.snippet_chars}, reply_tokens="
                             f"{tc.reply_tokens}): {failed[0]}")  # fmt: skip
        parts, cut, hits, total = [], 0, 0, 0
        for o in outs:
            prompt = np.asarray(o.prompt_token_ids, np.int32)
            reply, was_cut = np.asarray(o.token_ids, np.int32), False
            if tc.cut_repeats is not None:
                reply, was_cut = cut_at_repeat(reply, tc.cut_repeats)
            cut += was_cut
            h, t = lookup_share(reply)
            hits, total = hits + h, total + t
            reply = reply if was_cut or tc.reply_past_end else np.append(reply, np.int32(eos))
            parts += [np.stack([prompt, np.zeros_like(prompt)], 1),
                      np.stack([reply, np.ones_like(reply)], 1)]  # fmt: skip
        done = dict(stream=np.concatenate(parts), cut=cut, hits=hits, total=total)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.stem + ".part.npz")  # renamed when whole: never half a chunk
        np.savez(part, key=key, **done)
        part.replace(path)
        return done

    streams, stats = [], {}
    for split, n in (("train", tc.prompts), ("heldout", tc.heldout_prompts)):
        t0 = time.perf_counter()
        pieces = snippets(split_texts(tc, split), n, tc.snippet_chars)
        chunks = []
        for start in range(0, n, tc.reply_chunk):
            stop = min(start + tc.reply_chunk, n)
            chunks.append(chunk(split, pieces, start, stop))
            if stop < n:
                log(f"{tc.name}: {split}: {stop} of {n} replies ({time.perf_counter() - t0:.0f} s)")
        cut, hits, total = (int(sum(c[k] for c in chunks)) for k in ("cut", "hits", "total"))
        streams.append(np.concatenate([c["stream"] for c in chunks]))
        stats[split] = dict(replies=n, reply_tokens=total, cut=cut,
                            lookup_share=round(hits / max(total, 1), 4))  # fmt: skip
        log(f"{tc.name}: {split}: {n} replies of the target, {total:,} tokens kept ({cut} cut), "
            f"{stats[split]['lookup_share']:.1%} predictable by a 3-gram lookup, in "
            f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return streams[0], streams[1], stats


def train_eagle(tc: EagleTrainConfig, *, log=print) -> dict:
    """Train the head of `tc`, save it at `tc.head`; returns the run's summary (also written to
    `<out_dir>/metrics.json`, with a log of held-out agreement in `<out_dir>/log.jsonl`)."""
    t_start = time.perf_counter()
    cfg, params, tokenizer = load_model(tc.target, tc.target_dtype, tc.seed)
    if tokenizer is None:
        raise ValueError(f"train config: target={tc.target!r} has no tokenizer to read text with")
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.bos_token_id
    generated = None
    if tc.data == "generated":
        train, heldout_stream, generated = generated_streams(tc, eos, log)
    else:
        train = text_stream(tokenizer, tc, eos, "train")
        heldout_stream = text_stream(tokenizer, tc, eos, "heldout")
    heldout = eval_windows(heldout_stream, tc.seq_len, tc.eval_windows)
    vocab, coverage = None, None
    if tc.draft_vocab is not None:
        drafted = lambda st: st[st[:, 1] == 1, 0] if st.ndim == 2 else st  # noqa: E731
        vocab = top_tokens(drafted(train), tc.draft_vocab, cfg.vocab_size)
        coverage = round(float(np.isin(drafted(heldout_stream), vocab).mean()), 4)
        log(f"{tc.name}: draft vocabulary of {len(vocab):,} tokens, {coverage:.1%} of the "
            "held-out tokens drafted")  # fmt: skip
    log(f"{tc.name}: target {tc.target}, {len(train):,} train tokens ({tc.data}), "
        f"{len(heldout)} held-out windows of {tc.seq_len}")  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                  tc.lr * tc.min_lr_ratio)  # fmt: skip
    tx = optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                     optax.adamw(schedule, weight_decay=tc.weight_decay))  # fmt: skip
    taps = tuple(tc.feature_layers)
    if any(i >= cfg.num_layers for i in taps):
        raise ValueError(f"feature_layers={list(taps)}: target={tc.target!r} has "
                         f"{cfg.num_layers} layers (0 .. {cfg.num_layers - 1})")  # fmt: skip
    head = init_head(cfg, jax.random.key(tc.seed), tc.intermediate_size, feature_layers=taps)
    opt_state = tx.init(head)
    static = dict(cfg=cfg, tx=tx, distill=tc.distill, feature_weight=tc.feature_weight,
                  feature_noise=tc.feature_noise, unroll=tc.unroll,
                  unroll_decay=tc.unroll_decay, taps=taps)  # fmt: skip
    out = Path(tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.jsonl").write_text("")

    def evaluate() -> tuple[float, list[float]]:
        n = len(heldout) // tc.batch_size * tc.batch_size or len(heldout)
        batches = (window_weights(heldout[i : i + tc.batch_size])
                   for i in range(0, n, tc.batch_size))  # fmt: skip
        rows = [eval_step(head, params, jnp.asarray(t), jnp.asarray(w), cfg=cfg,
                          distill=tc.distill, unroll=tc.unroll, unroll_decay=tc.unroll_decay,
                          taps=taps)
                for t, w in batches]  # fmt: skip
        loss = float(np.mean([float(r[0]) for r in rows]))
        return loss, [round(float(a), 4) for a in np.mean([np.asarray(r[1]) for r in rows], 0)]

    def save(done: int, eval_loss: float, eval_agree: list[float]) -> dict:
        """Writes the head and metrics.json as of step `done` (every eval: a run cut short
        keeps its last one); returns the summary."""
        summary = {
            **provenance(),
            "name": tc.name, "target": tc.target, "steps": done, "data": tc.data,
            "generated": generated, "train_tokens": len(train),
            "train_tokens_seen": done * tc.batch_size * tc.seq_len,
            "head_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(head))),
            "heldout_agreement_before": agree0[0], "heldout_agreement": eval_agree[0],
            # step s's top-1 agreement given s - 1 kept drafts, fed its own features (unroll)
            "heldout_agreement_by_step": eval_agree,
            "expected_tokens_per_verification": round(expected_tokens(eval_agree), 3),
            "heldout_loss": round(eval_loss, 4), "draft_vocab": tc.draft_vocab,
            # the share of held-out tokens (with data "generated": reply tokens) in the vocabulary
            "draft_vocab_coverage": coverage,
            "train_s": round(time.perf_counter() - t0, 1),
            "total_s": round(time.perf_counter() - t_start, 1),
            "config": OmegaConf.to_container(OmegaConf.structured(tc)),
        }  # fmt: skip
        save_head(tc.head, jax.tree.map(lambda w: w.astype(tc.head_dtype), head), cfg,
                  {"train": summary, "feature_layers": list(taps)}, draft_vocab=vocab)  # fmt: skip
        (out / "metrics.json").write_text(json.dumps(summary, indent=2))
        return summary

    loss0, agree0 = evaluate()
    log(f"step 0: held-out loss {loss0:.3f}, agreement by draft step {agree0}")
    t0 = time.perf_counter()
    key = jax.random.key(tc.seed + 1)
    for step in range(tc.steps):
        tokens, weights = window_weights(train_batch(train, tc.seed, step, tc.batch_size,
                                                     tc.seq_len))  # fmt: skip
        head, opt_state, loss, agree = train_step(head, opt_state, params, jnp.asarray(tokens),
                                                  jnp.asarray(weights),
                                                  jax.random.fold_in(key, step), **static)  # fmt: skip
        done = step + 1
        if done % tc.eval_every == 0 or done == tc.steps:
            eval_loss, eval_agree = evaluate()
            row = dict(step=done, loss=float(loss), train_agreement=float(agree[0]),
                       heldout_loss=eval_loss, heldout_agreement=eval_agree[0],
                       heldout_agreement_by_step=eval_agree,
                       elapsed_s=round(time.perf_counter() - t0, 1))  # fmt: skip
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"step {done}: loss {float(loss):.3f}, held-out loss {eval_loss:.3f}, agreement "
                f"by draft step {eval_agree} ({row['elapsed_s']} s)")  # fmt: skip
            summary = save(done, eval_loss, eval_agree)
    return summary
