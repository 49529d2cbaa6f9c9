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

Held-out metric: top-1 agreement, the share of held-out positions where the head's argmax is
the target's (the acceptance of a first greedy draft, teacher-forced). The head is saved with
`eagle.save_head` (safetensors, as the shipped models' weights) and loaded by
`engine.speculative.eagle_head`.
"""

from __future__ import annotations

import json
import time
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
    head_forward_dense,
    init_head,
    save_head,
    shifted_features,
)
from jaxinfer.engine.loading import load_model
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_hidden
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

    _warmup = model_validator(mode="after")(warmup_in_range)


def is_eagle_config(path: str | Path | None, overrides=()) -> bool:
    """Whether a train config (file + overrides) asks for `kind: eagle`."""
    kinds = [o.split("=", 1)[1] for o in overrides if o.startswith("kind=")]
    if kinds:
        return kinds[-1] == "eagle"
    return path is not None and OmegaConf.load(path).get("kind") == "eagle"


def load_eagle_config(path: str | Path | None, overrides=()) -> EagleTrainConfig:
    """Schema <- YAML <- `key=value` overrides; errors name the offending key."""
    return load_config(EagleTrainConfig, path, overrides, what="train")


def text_stream(tokenizer, tc: EagleTrainConfig, eos: int, split: str) -> np.ndarray:
    """The split's files as one int32 token stream of the target's tokenizer, EOS between."""
    corpus = stdlib_corpus(heldout_fraction=tc.heldout_fraction)
    files = corpus.train if split == "train" else corpus.heldout
    skip = {m.replace(".", "/") for m in tc.exclude_modules}
    files = [f for f in files if f.with_suffix("").as_posix() not in skip
             and f.parent.as_posix() not in skip]  # fmt: skip
    if split == "train" and tc.max_files is not None:
        files = files[: tc.max_files]
    texts = [(corpus.root / f).read_text(encoding="utf-8", errors="replace") for f in files]
    parts = []
    for enc in tokenizer.encode_batch(texts):
        parts += [np.asarray(enc.ids, np.int32), np.asarray([eos], np.int32)]
    return np.concatenate(parts)


def head_loss(head, shared, cfg: ModelConfig, hidden, target_logits, tokens, key, *,
              distill: str, feature_weight: float, feature_noise: float):  # fmt: skip
    """(loss, top-1 agreement) of the head on windows: tokens [B, L], the frozen target's f
    [B, L, E] and logits [B, L, V]."""
    feats = shifted_features(hidden)
    if feature_noise:
        feats = feats + jax.random.uniform(key, feats.shape, feats.dtype, -1, 1) * feature_noise
    g = head_forward_dense(head, shared, cfg, feats, tokens)
    logits = compute_logits(shared, cfg, g)
    if distill == "soft":
        ce = optax.softmax_cross_entropy(logits, jax.nn.softmax(target_logits)).mean()
    else:
        labels = jnp.argmax(target_logits, -1)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    feature = optax.huber_loss(g.astype(jnp.float32), hidden.astype(jnp.float32)).mean()
    agree = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1))
    return ce + feature_weight * feature, agree


def _target_pass(target_params, cfg, tokens):
    hidden = forward_hidden(target_params, cfg, tokens)
    return hidden, compute_logits(target_params, cfg, hidden)


@partial(jax.jit, static_argnames=("cfg", "tx", "distill", "feature_weight", "feature_noise"),
         donate_argnums=(0, 1))  # fmt: skip
def train_step(head, opt_state, target_params, tokens, key, *, cfg, tx, distill, feature_weight,
               feature_noise):  # fmt: skip
    hidden, target_logits = _target_pass(target_params, cfg, tokens)  # frozen: no gradient
    shared = {k: target_params[k] for k in SHARED_KEYS if k in target_params}

    def loss_fn(h):
        return head_loss(h, shared, cfg, hidden, target_logits, tokens, key, distill=distill,
                         feature_weight=feature_weight, feature_noise=feature_noise)  # fmt: skip

    (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(head)
    updates, opt_state = tx.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, loss, agree


@partial(jax.jit, static_argnames=("cfg", "distill"))
def eval_step(head, target_params, tokens, *, cfg, distill):
    hidden, target_logits = _target_pass(target_params, cfg, tokens)
    shared = {k: target_params[k] for k in SHARED_KEYS if k in target_params}
    return head_loss(head, shared, cfg, hidden, target_logits, tokens, None, distill=distill,
                     feature_weight=1.0, feature_noise=0.0)  # fmt: skip


def train_eagle(tc: EagleTrainConfig, *, log=print) -> dict:
    """Train the head of `tc`, save it at `tc.head`; returns the run's summary (also written to
    `<out_dir>/metrics.json`, with a log of held-out agreement in `<out_dir>/log.jsonl`)."""
    t_start = time.perf_counter()
    cfg, params, tokenizer = load_model(tc.target, tc.target_dtype, tc.seed)
    if tokenizer is None:
        raise ValueError(f"train config: target={tc.target!r} has no tokenizer to read text with")
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.bos_token_id
    train = text_stream(tokenizer, tc, eos, "train")
    heldout = eval_windows(text_stream(tokenizer, tc, eos, "heldout"), tc.seq_len,
                           tc.eval_windows)  # fmt: skip
    log(f"{tc.name}: target {tc.target}, {len(train):,} train tokens, {len(heldout)} held-out "
        f"windows of {tc.seq_len}")  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                                  tc.lr * tc.min_lr_ratio)  # fmt: skip
    tx = optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                     optax.adamw(schedule, weight_decay=tc.weight_decay))  # fmt: skip
    head = init_head(cfg, jax.random.key(tc.seed), tc.intermediate_size)
    opt_state = tx.init(head)
    static = dict(cfg=cfg, tx=tx, distill=tc.distill, feature_weight=tc.feature_weight,
                  feature_noise=tc.feature_noise)  # fmt: skip
    out = Path(tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.jsonl").write_text("")

    def evaluate() -> tuple[float, float]:
        n = len(heldout) // tc.batch_size * tc.batch_size or len(heldout)
        rows = [eval_step(head, params, jnp.asarray(heldout[i : i + tc.batch_size]), cfg=cfg,
                          distill=tc.distill) for i in range(0, n, tc.batch_size)]  # fmt: skip
        return tuple(float(np.mean([float(r[i]) for r in rows])) for i in (0, 1))

    loss0, agree0 = evaluate()
    log(f"step 0: held-out loss {loss0:.3f}, top-1 agreement {agree0:.3f}")
    t0 = time.perf_counter()
    key = jax.random.key(tc.seed + 1)
    for step in range(tc.steps):
        tokens = jnp.asarray(train_batch(train, tc.seed, step, tc.batch_size, tc.seq_len))
        head, opt_state, loss, agree = train_step(head, opt_state, params, tokens,
                                                  jax.random.fold_in(key, step), **static)  # fmt: skip
        done = step + 1
        if done % tc.eval_every == 0 or done == tc.steps:
            eval_loss, eval_agree = evaluate()
            row = dict(step=done, loss=float(loss), train_agreement=float(agree),
                       heldout_loss=eval_loss, heldout_agreement=eval_agree,
                       elapsed_s=round(time.perf_counter() - t0, 1))  # fmt: skip
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"step {done}: loss {float(loss):.3f}, held-out loss {eval_loss:.3f}, top-1 "
                f"agreement {eval_agree:.3f} ({row['elapsed_s']} s)")  # fmt: skip
    summary = {
        "name": tc.name, "target": tc.target, "steps": tc.steps,
        "train_tokens_seen": tc.steps * tc.batch_size * tc.seq_len,
        "head_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(head))),
        "heldout_agreement_before": round(agree0, 4), "heldout_agreement": round(eval_agree, 4),
        "heldout_loss": round(eval_loss, 4), "train_s": round(time.perf_counter() - t0, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
        "config": OmegaConf.to_container(OmegaConf.structured(tc)),
    }  # fmt: skip
    save_head(tc.head, jax.tree.map(lambda w: w.astype(tc.head_dtype), head), cfg,
              {"train": summary})  # fmt: skip
    (out / "metrics.json").write_text(json.dumps(summary, indent=2))
    return summary
