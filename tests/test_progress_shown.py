"""The long silent steps say what they do: each install step of `make`, `jaxinfer eval-ppl`'s
windows scored of N, training's load phase before its step bar (issue 35)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from jaxinfer.assets import reference_model_dir
from jaxinfer.train import trainer
from jaxinfer.train.config import load_train_config
from jaxinfer.train.evaluate import heldout_perplexity

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_pip_install_of_the_makefile_is_announced_with_its_duration(tmp_path):
    # -n: print the commands only; -B: as on a fresh clone (every target out of date)
    dry = subprocess.run(["make", "-n", "-B", "install-test", f"VENV={tmp_path / 'venv'}"],
                         cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    lines = dry.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if " pip " in line and " install " in line]
    assert len(installs) >= 3, lines  # jaxinfer, torch, the test extra
    for i in installs:
        said = lines[i - 1]
        assert said.startswith("echo ") and "installing" in said and "minute" in said, lines


def test_eval_ppl_shows_windows_scored_of_n_on_stderr(capsys):
    result = heldout_perplexity(reference_model_dir("tiny"), max_windows=32)
    out, err = capsys.readouterr()
    assert result["heldout_tokens"] == 32 * 256
    assert "tiny" in err and "windows" in err and "32/32" in err, err
    assert out == ""  # stdout carries the result rows of `jaxinfer eval-ppl`


def test_training_shows_its_load_phase_before_the_step_bar(tmp_path, capsys):
    tc = load_train_config(None, [
        "name=p", "steps=1", "warmup_steps=0", "seq_len=32", "batch_size=2", "eval_every=1",
        "eval_windows=2", "checkpoint_every=1", f"out_dir={tmp_path}", "model.hidden_size=32",
        "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16",
    ])  # fmt: skip
    trainer.train(tc, show_progress=True)
    out = capsys.readouterr().out
    assert "train tokens" in out and "2 held-out windows" in out, out
    assert out.index("train tokens") < out.index("1/1"), out  # before the step bar's line
