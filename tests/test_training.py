"""Corpus, tokenizer, config and the training loop (loss goes down; an interrupted run resumes)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.train import trainer
from jaxinfer.train.config import BUILTIN_TOKENIZER, load_train_config
from jaxinfer.train.corpus import stdlib_corpus
from jaxinfer.train.data import eval_windows, train_batch
from jaxinfer.train.tokenizer import EOS, train_bpe_tokenizer

TINY_SHAPE = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
]


def interrupted_at(n: int, step):
    """`step` that raises KeyboardInterrupt (a Ctrl-C) on its n-th call instead of running."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    return wrapped


def test_corpus_split_is_deterministic_disjoint_and_by_file():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert a.train == b.train and a.heldout == b.heldout
    assert not set(a.train) & set(a.heldout)
    assert len(a.heldout) > 5 and len(a.train) > 10 * len(a.heldout)
    assert all(p.suffix == ".py" and "test" not in p.parts for p in a.train + a.heldout)


def test_byte_level_bpe_round_trips_any_text(tmp_path):
    texts = stdlib_corpus().texts("train")[:20]
    tok = train_bpe_tokenizer(texts, 400, tmp_path / "tok.json")
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == 400
    sample = "def f(x):\n\treturn 'ünï' + x  # ☃\n"
    assert tok.decode(tok.encode(sample).ids) == sample


def test_batches_are_a_function_of_seed_and_step():
    stream = np.arange(10_000, dtype=np.int32)
    a = train_batch(stream, 0, 7, 4, 32)
    np.testing.assert_array_equal(a, train_batch(stream, 0, 7, 4, 32))
    assert not np.array_equal(a, train_batch(stream, 0, 8, 4, 32))
    assert a.shape == (4, 33) and (np.diff(a, axis=1) == 1).all()
    w = eval_windows(stream, 100)
    assert w.shape == (99, 101) and w[1, 0] == w[0, -1]  # every target scored exactly once


def test_bad_train_config_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="no_such_key"):
        load_train_config(None, ["name=x", "no_such_key=1", *TINY_SHAPE])
    with pytest.raises(ValueError, match="steps"):
        load_train_config(None, ["name=x", "steps=0", *TINY_SHAPE])
    with pytest.raises(ValueError, match="hidden_size"):
        load_train_config(None, ["name=x", "model.hidden_size=big"])


def test_training_reduces_loss_from_a_fixed_seed():
    tc = load_train_config(None, ["name=t", "steps=30", "warmup_steps=2", "lr=1e-2", *TINY_SHAPE])
    cfg = trainer.model_config(tc, vocab_size=64, eos_id=0)
    tx = trainer.make_optimizer(tc)
    params = trainer.init_params(cfg, jax.random.key(0))
    opt_state = tx.init(params)
    # A learnable stream: a fixed random sequence of 64-token "lines" repeated.
    line = np.random.default_rng(0).integers(0, 64, 64)
    stream = np.tile(line, 200).astype(np.int32)
    losses = []
    for step in range(tc.steps):
        tokens = jnp.asarray(train_batch(stream, 0, step, 8, 32))
        params, opt_state, loss, _ = trainer.train_step(params, opt_state, tokens, cfg=cfg, tx=tx)
        losses.append(float(loss))
    assert losses[0] > np.log(64) - 0.5, losses[0]  # starts near uniform
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses


def test_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    overrides = [
        "name=r", "steps=6", "warmup_steps=1", "seq_len=32", "batch_size=2", "eval_every=3",
        "eval_windows=2", "checkpoint_every=2", *TINY_SHAPE,
    ]  # fmt: skip
    _, straight, _ = trainer.train(
        load_train_config(None, [*overrides, f"out_dir={tmp_path / 'a'}"]), show_progress=False
    )

    real_step = trainer.train_step
    tc = load_train_config(None, [*overrides, f"out_dir={tmp_path / 'b'}"])
    monkeypatch.setattr(trainer, "train_step", interrupted_at(5, real_step))
    with pytest.raises(KeyboardInterrupt):
        trainer.train(tc, show_progress=False)
    monkeypatch.setattr(trainer, "train_step", real_step)
    _, resumed, summary = trainer.train(tc, show_progress=False)
    assert summary["resumed_from_step"] == 4
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="different config"):
        trainer.train(load_train_config(None, [*overrides, "steps=7", f"out_dir={tmp_path / 'b'}"]))


def test_ctrl_c_during_train_says_in_one_line_where_it_stopped_and_keeps_the_checkpoint(
    tmp_path, monkeypatch, capsys
):
    from jaxinfer.cli import main

    monkeypatch.setattr(trainer, "train_step", interrupted_at(5, trainer.train_step))
    config = tmp_path / "train.yaml"
    config.write_text("name: r\n")
    out = tmp_path / "run"
    overrides = [
        "steps=6", "warmup_steps=1", "seq_len=32", "batch_size=2", "eval_every=3",
        "eval_windows=2", "checkpoint_every=2", f"out_dir={out}", *TINY_SHAPE,
    ]  # fmt: skip
    assert main(["train", str(config), *overrides, "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("jaxinfer train: interrupted after step 4 of 6: the checkpoint of step 4")
    assert str(out / "checkpoints") in err and "rerunning the same command resumes" in err
    assert trainer.ocp.CheckpointManager(out / "checkpoints").latest_step() == 4  # work kept


def test_ctrl_c_during_eagle_head_training_is_one_line_and_keeps_its_log(
    tmp_path, monkeypatch, capsys
):
    from jaxinfer.cli import main
    from jaxinfer.train import eagle

    monkeypatch.setattr(eagle, "train_step", interrupted_at(3, eagle.train_step))
    config = tmp_path / "eagle.yaml"
    config.write_text("kind: eagle\nname: e\ntarget: tiny\n")
    out = tmp_path / "run"
    overrides = [
        "max_files=4", "seq_len=32", "batch_size=2", "steps=4", "warmup_steps=1",
        "eval_every=1", "eval_windows=2", f"out_dir={out}", f"head={tmp_path / 'h.safetensors'}",
    ]  # fmt: skip
    assert main(["train", str(config), *overrides]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("jaxinfer train: interrupted;") and "starts the head over" in err, err
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the evaluations before the Ctrl-C, kept


def test_builtin_tokenizer_is_shipped():
    assert BUILTIN_TOKENIZER.exists()
