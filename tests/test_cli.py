"""The `jaxinfer` command line around its commands: one-line errors (and --debug's traceback),
options and positionals in any order, results folders never reused unasked, --version,
--print-config and the help of every flag. (A run's own behaviour: test_run_experiment.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

import jaxinfer
from jaxinfer import cli
from jaxinfer.cli import main
from jaxinfer.experiment import run as runs
from jaxinfer.experiment import sweep as sweep_mod

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"
NOT_CHECKED = {"generate"}  # (its flags are being rewritten)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"jaxinfer {jaxinfer.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["run", "{cfg}", "engine.no_such_key=1"], ["engine.no_such_key", "EngineConfig"]),
        (["run", "{tmp}/missing.yaml"], ["No such file", "missing.yaml"]),
        (["run", "{cfg}", "engine.model={tmp}/no_model"], ["no_model", "no such file or directory"]),
        (["run", "{cfg}", "engine.dtype=float64x"], ["'float64x'", "float32, bfloat16, float16"]),
        (["run", "{cfg}", "engine.scheduler", "static"],
         ["'engine.scheduler'", "key=value", "engine.scheduler=static?"]),
        (["sweep", "{cfg}", "engine.scheduler", "static"], ["'engine.scheduler'", "key=value"]),
        (["sweep", "{cfg}", "--grid", "engine.scheduler=lifo,fcfs"], ["scheduler", "lifo"]),
        (["report", "{tmp}/nothing"], ["nothing: no such folder"]),
        (["generate", "--model", "llama3-8b", "--prompt", "hi"], ["'llama3-8b'", "tiny, tiny-draft, smollm2",
                                                "preset:NAME (", "did you mean preset:llama3-8b?"]),
        (["generate", "--model", "tinny", "--prompt", "hi"], ["did you mean tiny?"]),
    ],
)  # fmt: skip
def test_a_users_error_is_one_line_with_exit_status_2(tmp_path, capsys, argv, fragments):
    """Config, checkpoint, validation and missing-path errors: `jaxinfer CMD: error: MESSAGE`
    alone on stderr, nothing written (the out_dir is not made)."""
    out = tmp_path / "out"
    argv = [a.format(cfg=QUICKSTART, tmp=tmp_path) for a in argv]
    if argv[0] in ("run", "sweep"):
        argv.append(f"out_dir={out}")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"jaxinfer {argv[0]}: error: "), captured.err
    for fragment in fragments:
        assert fragment in captured.err, (fragment, captured.err)
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()


def test_debug_flag_raises_the_error_with_its_traceback():
    with pytest.raises(ValueError, match=r"engine\.no_such_key"):
        main(["--debug", "run", str(QUICKSTART), "engine.no_such_key=1"])


def test_overrides_are_accepted_before_and_after_the_options(monkeypatch, tmp_path):
    """`jaxinfer sweep CONFIG --grid k=a,b more=overrides`, as its usage line shows them."""
    planned = []

    def plan_sweep(config, overrides, *, grid, zipped):
        planned.append((Path(config), list(overrides), grid, zipped))
        return "plan"

    monkeypatch.setattr(sweep_mod, "plan_sweep", plan_sweep)
    monkeypatch.setattr(sweep_mod, "run_sweep", lambda plan, **kw: argparse.Namespace(ok=True))
    argv = ["sweep", str(QUICKSTART), "workload.seed=1", "--grid", "engine.scheduler=fcfs,static",
            "workload.num_requests=2", "--zip", "workload.arrival.rate=1,2", "name=late"]  # fmt: skip
    assert main(argv) == 0
    assert planned == [
        (QUICKSTART, ["workload.seed=1", "workload.num_requests=2", "name=late"],
         {"engine.scheduler": ["fcfs", "static"]}, {"workload.arrival.rate": [1, 2]}),
    ]  # fmt: skip


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runs, "run_experiment", lambda *a, **k: pytest.fail("it ran"))
    out = tmp_path / "run"
    argv = ["run", str(QUICKSTART), "--print-config", "engine.scheduler=static", f"out_dir={out}"]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = dataclasses.asdict(runs.load_run_config(QUICKSTART, argv[3:]))
    assert printed == json.loads(json.dumps(expected))  # (tuples as lists)
    assert printed["engine"]["scheduler"] == "static" and printed["out_dir"] == str(out)
    assert not out.exists()


def test_run_help_lists_every_config_section_and_the_file_of_its_schema(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "config [overrides ...]" in text  # optional, as usage shows it
    for f in dataclasses.fields(runs.RunConfig):
        assert re.search(rf"\b{f.name}\b", text), f.name
        default = getattr(runs.RunConfig(), f.name)
        if dataclasses.is_dataclass(default):  # a section: its schema class, in its file
            file = Path(inspect.getsourcefile(type(default))).relative_to(REPO)
            assert f"{f.name} {type(default).__name__}, {file}:" in text, f.name


def test_every_flag_of_every_command_has_help_showing_its_default():
    commands = _subparsers(cli.build_parser())
    assert {"quickstart", "run", "sweep", "train", "eval-ppl", "report"} <= commands.keys()
    for name, parser in commands.items():
        if name in NOT_CHECKED:
            continue
        helptext = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)
            d = action.default
            if d is not None and d is not False and d != []:
                assert f"(default: {d})" in helptext, (name, action.dest)


def _fake_run(monkeypatch, calls: list[Path]) -> None:
    """run_experiment writing a metrics.json that says which call wrote it (no model run)."""

    def run_experiment(rc, **kwargs):
        out = Path(rc.out_dir)
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        metrics = {"call": len(calls), "num_requests": 1, "num_completed": 1}
        (out / "metrics.json").write_text(json.dumps(metrics))
        return {**metrics, "compiles_after_warmup": 0}

    monkeypatch.setattr(runs, "run_experiment", run_experiment)


def test_a_run_never_writes_into_another_runs_folder_unless_overwrite(
    tmp_path, capsys, monkeypatch
):
    calls: list[Path] = []
    _fake_run(monkeypatch, calls)
    out = tmp_path / "quickstart"
    argv = ["run", str(QUICKSTART), f"out_dir={out}", "--no-progress"]
    for _ in range(3):  # the 2nd and 3rd within one second: still two new folders
        assert main(argv) == 0
    assert calls[0] == out and len(set(calls)) == 3
    for n, folder in enumerate(calls[1:], 2):
        assert folder.parent == tmp_path
        assert re.fullmatch(r"quickstart-\d{8}-\d{6}(-\d+)?", folder.name), folder.name
        assert json.loads((folder / "metrics.json").read_text())["call"] == n
    assert json.loads((out / "metrics.json").read_text())["call"] == 1  # the first run's, kept
    printed = capsys.readouterr().out
    assert [f"results: {c}" for c in calls] == re.findall(r"results: \S+", printed)
    assert main([*argv, "--overwrite"]) == 0
    assert calls[-1] == out and json.loads((out / "metrics.json").read_text())["call"] == 4


def test_quickstart_never_writes_into_another_runs_folder_unless_overwrite(
    tmp_path, capsys, monkeypatch
):
    """(Generation faked: each token is the argmax of a forward that predicts it, so the
    self-check passes; what is tested is where the results go.)"""
    monkeypatch.setattr(cli, "greedy_generate", lambda p, c, ps, n, **kw: [[1] * n] * len(ps))
    monkeypatch.setattr(
        cli, "forward", lambda p, c, seq: jax.nn.one_hot(jnp.roll(seq, -1, 1), c.vocab_size)
    )
    out = tmp_path / "quickstart"
    out.mkdir()
    (out / "env.json").write_text("{}")  # an earlier run's
    argv = ["quickstart", "--preset", "tiny", "--max-new-tokens", "2", "--out", str(out)]
    assert main(argv) == 0
    (sibling,) = [p for p in tmp_path.iterdir() if p != out]
    assert sorted(p.name for p in out.iterdir()) == ["env.json"]
    assert json.loads((sibling / "metrics.json").read_text())["output_tokens"] == 16
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"results: {sibling}"
    assert main([*argv, "--overwrite"]) == 0
    assert (out / "metrics.json").is_file() and len(list(tmp_path.iterdir())) == 2


def test_every_entry_point_resolves_one_default_dtype_float32_on_cpu(monkeypatch):
    # the CLI defaulted to bfloat16 and LLM() to float32: bf16 on a CPU differs from CPU to
    # CPU (smollm2 answered wrongly on some); every default is now "auto", one resolution
    from jaxinfer.engine import llm as llm_mod
    from jaxinfer.engine.config import EngineConfig, resolve_dtype
    from jaxinfer.serve.server import load_serve_config

    assert jax.default_backend() == "cpu"
    given = {}

    class Captured(Exception):
        pass

    def fake_llm(model, warmup=True, **kwargs):
        given.update(kwargs)
        raise Captured

    monkeypatch.setattr(llm_mod, "LLM", fake_llm)
    with pytest.raises(Captured):
        cli.generate(
            cli.build_parser().parse_args(["generate", "--model", "tiny", "--prompt", "x"])
        )
    assert "dtype" not in given  # (left to EngineConfig's default)
    defaults = {
        "jaxinfer generate": EngineConfig(**given).dtype,
        "LLM() / EngineConfig": EngineConfig().dtype,
        "jaxinfer run": runs.load_run_config(None).engine.dtype,
        "jaxinfer serve": load_serve_config(None).engine.dtype,
    }
    assert {k: resolve_dtype(v) for k, v in defaults.items()} == dict.fromkeys(defaults, "float32")
    monkeypatch.undo()  # and the engine runs in what it resolved
    tiny = llm_mod.LLM("tiny", warmup=False, num_pages=8, max_model_len=64)
    assert tiny.engine.config.dtype == "float32" and tiny.engine.model_config.dtype == "float32"


@pytest.mark.parametrize(
    ("argv", "orig_argv", "by_module", "command"),
    [
        (["/src/jaxinfer/cli.py", "run", "c.yaml"], ["python", "-m", "jaxinfer.cli", "run", "c.yaml"],
         True, "python -m jaxinfer.cli run c.yaml"),
        (["/venv/bin/jaxinfer", "run", "c.yaml"], ["/venv/bin/python", "/venv/bin/jaxinfer", "run",
         "c.yaml"], False, "jaxinfer run c.yaml"),
    ],
)  # fmt: skip
def test_env_records_the_command_as_typed(monkeypatch, argv, orig_argv, by_module, command):
    from jaxinfer.provenance import provenance

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    main_module = types.SimpleNamespace(__spec__=object() if by_module else None)
    monkeypatch.setitem(sys.modules, "__main__", main_module)
    assert provenance()["command"] == command
