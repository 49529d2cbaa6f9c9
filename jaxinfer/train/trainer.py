"""Causal-LM training of our dense decoder with optax, on CPU or GPU, resumable via orbax.

AdamW with linear warm-up + cosine decay and global-norm clipping; fp32 master weights and optimizer
state, forward/backward in `compute_dtype` (bf16 by default); loss in fp32.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tokenizers import Tokenizer

from jaxinfer.config_file import to_yaml
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import forward
from jaxinfer.models.spec import Params, init_params
from jaxinfer.train.config import TrainConfig
from jaxinfer.train.corpus import stdlib_corpus
from jaxinfer.train.data import encode_stream, eval_windows, train_batch
from jaxinfer.train.tokenizer import EOS, train_bpe_tokenizer


def model_config(tc: TrainConfig, vocab_size: int, eos_id: int) -> ModelConfig:
    """The trained model's config: fp32 master weights; `dtype` is the compute dtype."""
    return ModelConfig(
        vocab_size=vocab_size,
        **vars(tc.model),
        param_dtype="float32",
        dtype=tc.compute_dtype,
        bos_token_id=eos_id,
        eos_token_ids=(eos_id,),
    )


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warm-up and cosine decay, clipped; one object per set of hyperparameters, so a
    second run in this process (a resume, a sweep point) reuses the compiled `train_step` (its
    `tx` is a static argument, compared by identity)."""
    return _optimizer(tc.lr, tc.warmup_steps, tc.steps, tc.min_lr_ratio, tc.grad_clip, tc.b1,
                      tc.b2, tc.weight_decay)  # fmt: skip


@lru_cache(maxsize=16)
def _optimizer(lr, warmup_steps, steps, min_lr_ratio, grad_clip, b1, b2, weight_decay):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup_steps,
        decay_steps=steps,
        end_value=lr * min_lr_ratio,
    )

    def decay_mask(params):  # no weight decay on norms and biases
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


def lm_loss(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of windows [B, L+1], computed in `cfg.dtype`."""
    compute = jax.tree.map(lambda p: p.astype(cfg.jnp_dtype), params)
    logits = forward(compute, cfg, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@partial(jax.jit, static_argnames=("cfg", "tx"), donate_argnums=(0, 1))
def train_step(params, opt_state, tokens, *, cfg: ModelConfig, tx):
    loss, grads = jax.value_and_grad(lm_loss)(params, cfg, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


@partial(jax.jit, static_argnames=("cfg",))
def _eval_loss(params, tokens, *, cfg: ModelConfig):
    return lm_loss(params, cfg, tokens)


def heldout_loss(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    batch_size: int,
    on_batch: Callable[[int], object] | None = None,
) -> float:
    """Mean nats per token over `windows` (full batches; the remainder is dropped). `on_batch(n)`
    is called after each batch with its number of windows (a progress bar's advance)."""
    n = max(1, len(windows) // batch_size) * batch_size
    windows = windows[:n] if len(windows) >= batch_size else windows
    losses = []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        losses.append(float(_eval_loss(params, jnp.asarray(batch), cfg=cfg)))
        if on_batch is not None:
            on_batch(len(batch))
    return float(np.mean(losses))


def load_or_train_tokenizer(tc: TrainConfig, corpus) -> Tokenizer:
    path = tc.tokenizer_path
    if path.exists():
        return Tokenizer.from_file(str(path))
    return train_bpe_tokenizer(corpus.texts("train"), tc.vocab_size, path)


def load_data(
    tc: TrainConfig, status: Callable[[str], object] = lambda text: None
) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """(tokenizer, train token stream, held-out windows) of `tc`; `status(text)` names each phase
    as it starts (a fresh tokenizer is trained, and the train split is tokenized: seconds). The
    token streams are kept in the run's `out_dir` (`tokens.npz`), so a resumed run reads the
    streams its first part trained on instead of tokenizing again."""
    status("reading the stdlib corpus")
    corpus = stdlib_corpus(
        heldout_fraction=tc.heldout_fraction, include_tests=tc.corpus_include_tests
    )
    trains = not tc.tokenizer_path.exists()
    status(f"{'training' if trains else 'loading'} the tokenizer ({tc.tokenizer_path.name})")
    tokenizer = load_or_train_tokenizer(tc, corpus)
    cached = Path(tc.out_dir) / "tokens.npz"
    if cached.exists():
        status(f"loading the token streams ({cached.name})")
        with np.load(cached) as f:
            train_stream, heldout_stream = f["train"], f["heldout"]
    else:
        status(f"tokenizing {len(corpus.train)} train and {len(corpus.heldout)} held-out files")
        train_stream = encode_stream(tokenizer, corpus.texts("train"))
        heldout_stream = encode_stream(tokenizer, corpus.texts("heldout"))
        partial_file = cached.with_name("tokens.partial.npz")  # (an interrupted save is not read)
        np.savez(partial_file, train=train_stream, heldout=heldout_stream)
        partial_file.replace(cached)
    return tokenizer, train_stream, eval_windows(heldout_stream, tc.seq_len, tc.eval_windows)


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training; the message says after which step and what checkpoint is kept."""


class _Log:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **row) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def train(tc: TrainConfig, *, show_progress: bool = True) -> tuple[ModelConfig, Params, dict]:
    """Train (or resume) the run in `tc.out_dir`; returns (config, fp32 params, summary)."""
    out = Path(tc.out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "train_config.yaml"
    if saved.exists() and saved.read_text() != to_yaml(tc):
        raise ValueError(
            f"{out} holds a run with a different config ({saved}); use another out_dir to "
            "start a new run"
        )
    saved.write_text(to_yaml(tc))

    loading = (SpinnerColumn(finished_text="[green]✓"), TextColumn(f"[bold]{tc.name}"),
               TextColumn("{task.description}"), TimeElapsedColumn())  # fmt: skip
    with Progress(*loading, disable=not show_progress) as progress:
        task = progress.add_task("", total=None)
        tokenizer, train_stream, heldout = load_data(
            tc, lambda text: progress.update(task, description=text)
        )
        progress.update(task, total=1, completed=1, description=f"data: {len(train_stream):,} "
                        f"train tokens, {len(heldout)} held-out windows")  # fmt: skip
    eos = tokenizer.token_to_id(EOS)
    cfg = model_config(tc, tokenizer.get_vocab_size(), eos)
    tx = make_optimizer(tc)

    params = init_params(cfg, jax.random.key(tc.seed))
    opt_state = tx.init(params)
    manager = ocp.CheckpointManager(
        out / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, opt_state))
        params, opt_state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
    log = _Log(out / "log.jsonl")
    summary: dict = {"resumed_from_step": start, "tokens_per_step": tc.batch_size * tc.seq_len}

    columns = (
        TextColumn(f"[bold]{tc.name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    )
    t0, done = time.perf_counter(), start
    try:
        with Progress(*columns, disable=not show_progress) as progress:
            task = progress.add_task("train", total=tc.steps, completed=start, status="")
            for step in range(start, tc.steps):
                tokens = jnp.asarray(
                    train_batch(train_stream, tc.seed, step, tc.batch_size, tc.seq_len)
                )
                params, opt_state, loss, gnorm = train_step(
                    params, opt_state, tokens, cfg=cfg, tx=tx
                )
                done = step + 1
                if done % tc.eval_every == 0 or done == tc.steps:
                    eval_loss = heldout_loss(params, cfg, heldout, tc.batch_size)
                    row = dict(step=done, loss=float(loss), grad_norm=float(gnorm))
                    log.write(**row, heldout_loss=eval_loss, elapsed_s=time.perf_counter() - t0)
                    progress.update(task, status=f"loss {float(loss):.3f} held-out {eval_loss:.3f}")
                if done % tc.checkpoint_every == 0 or done == tc.steps:
                    manager.save(done, args=ocp.args.StandardSave((params, opt_state)))
                progress.update(task, completed=done)
    except KeyboardInterrupt as e:
        manager.wait_until_finished()  # a checkpoint being written (async) is kept whole
        kept = manager.latest_step()
        manager.close()
        where = f"interrupted after step {done} of {tc.steps}"
        if kept is None:
            raise TrainInterrupted(
                f"{where}, before the first checkpoint (every {tc.checkpoint_every} steps): "
                f"rerunning starts again"
            ) from e
        raise TrainInterrupted(
            f"{where}: the checkpoint of step {kept} is kept in {out / 'checkpoints'}; "
            f"rerunning the same command resumes from it"
        ) from e
    manager.wait_until_finished()
    manager.close()
    summary["train_s_this_run"] = round(time.perf_counter() - t0, 1)
    summary["final_train_loss"] = float(loss) if tc.steps > start else None
    return cfg, params, summary


def perplexity(nats_per_token: float) -> float:
    return math.exp(nats_per_token)
