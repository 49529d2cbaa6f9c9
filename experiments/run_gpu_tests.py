"""Run `-m gpu` tests and record what passed, with provenance: the results file of a GPU
correctness run (`experiments/results/h200/gpu_tests_<name>.json`).

    python experiments/run_gpu_tests.py --out $OUT/gpu_tests.json -- tests/test_gpu_engine.py -k bf16

Everything after `--` goes to pytest (`-m gpu -q` and a JUnit report are added). The file holds
each test's outcome and seconds, pytest's summary line and exit code; it is written even when
tests fail (the exit code is pytest's) or `--timeout-s` interrupts them (then with the tests
finished by then). pytest's output streams through as it runs.

The whole GPU suite runs longer than one device call may (10 minutes), so it runs in shards,
each shard in its own device call:

    for i in 1 2 3 4; do python experiments/run_gpu_tests.py --shard $i/4 --out $OUT/gpu_tests_shard$i.json; done

`--shard I/N` (1-based) collects the `-m gpu` tests (`pytest --collect-only -q -m gpu` plus the
pytest arguments), splits them into N shards and runs shard I only (tests/conftest.py's
`--only-tests`), adding `shard`, `shard_tests` (its node ids) and `collected` (the whole
selection's node ids) to the file. The split depends on the collected node ids only, so the N
calls on one tree (same arguments) are disjoint and together run every collected test: the
tests are grouped by file, a file larger than a shard's fair share (ceil(tests / N)) is cut into
near-equal runs of its sorted ids, and the groups, largest first (ties by first id), go to the
shard holding the fewest tests so far (ties to the lowest I). Balanced by test count, not by
time (recorded durations would make the split change as results files are rewritten).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxinfer.provenance import provenance  # noqa: E402


def parse_junit(path: Path) -> list[dict]:
    """[{test, outcome, seconds}] from a pytest JUnit XML report."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        if not case.get("name"):  # the test an interrupt (--timeout-s) cut short
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rows.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0))})
    return rows


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 1 <= I <= N (argparse names the option in the refusal)."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 2/4)")
    i, n = int(match[1]), int(match[2])
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be 1 to N (1-based)")
    return i, n


def collect(pytest_args: list[str]) -> list[str]:
    """The node ids `pytest --collect-only -q -m gpu *pytest_args` selects (nothing runs)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *pytest_args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 5):  # 5: no test selected
        raise SystemExit(f"collecting the GPU tests failed ({proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")  # fmt: skip
    # one node id a line (`path::name[params]`), then a blank line, the count and any warnings
    ids = []
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith("="):
            break
        if "::" in line:
            ids.append(line)
    return ids


def split(node_ids: list[str], n: int) -> list[list[str]]:
    """The N shards of `node_ids` (each sorted): see the module's docstring."""
    by_file: dict[str, list[str]] = {}
    for nodeid in sorted(set(node_ids)):
        by_file.setdefault(nodeid.split("::")[0], []).append(nodeid)
    share = max(1, math.ceil(len(node_ids) / n))
    groups = []
    for ids in by_file.values():
        parts = math.ceil(len(ids) / share)  # a file within its fair share stays whole
        size = math.ceil(len(ids) / parts)
        groups += [ids[j : j + size] for j in range(0, len(ids), size)]
    shards: list[list[str]] = [[] for _ in range(n)]
    for group in sorted(groups, key=lambda g: (-len(g), g[0])):
        emptiest = min(range(n), key=lambda j: (len(shards[j]), j))
        shards[emptiest].extend(group)
    return [sorted(s) for s in shards]


def run_streaming(cmd: list[str], timeout_s: float | None) -> tuple[int, str, bool]:
    """Runs `cmd`, echoing its output (stdout and stderr merged) as it comes, so a device call
    cut short still shows how far it got. Past `timeout_s` pytest gets SIGINT: it stops, writes
    its JUnit report of the tests finished and its summary; a minute later it is killed.
    Returns (exit code, the output, whether it timed out)."""
    # A child inherits SIGINT ignored (as a background job or a pytest-xdist worker runs this),
    # and Python then never turns it into KeyboardInterrupt; a handled SIGINT is reset to the
    # default at exec. So SIGINT is handled here while the child starts.
    ignored = None
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        with contextlib.suppress(ValueError):  # (not the main thread: left as it is)
            ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)  # fmt: skip
    finally:
        if ignored is not None:
            signal.signal(signal.SIGINT, ignored)
    out: list[str] = []

    def pump():
        for line in proc.stdout:
            out.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    return proc.returncode, "".join(out), timed_out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shard", type=parse_shard, metavar="I/N",
                    help="run shard I (1-based) of N of the collected GPU tests")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="interrupt pytest (SIGINT) after this many seconds: the tests finished "
                         "by then are still recorded, with timed_out true")  # fmt: skip
    args = ap.parse_args(ours)
    sharding = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        junit = tmp / "junit.xml"
        if args.shard:
            i, n = args.shard
            collected = collect(pytest_args)
            shard = split(collected, n)[i - 1]
            only = tmp / "shard_tests.txt"
            only.write_text("".join(f"{nodeid}\n" for nodeid in shard))
            # `--only-tests=FILE` as one word: pytest reads its paths before conftest.py declares
            # the option, so a separate FILE would be taken for the tests' root. The shard's files
            # are named, so only they are collected (and the conftest beside them is loaded).
            files = [f for f in dict.fromkeys(i.split("::")[0] for i in shard)
                     if f not in pytest_args]  # fmt: skip
            pytest_args = [f"--only-tests={only}", *pytest_args, *files]
            sharding = {"shard": f"{i}/{n}", "shard_tests": shard, "collected": collected}
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={junit}",
               *pytest_args]  # fmt: skip
        returncode, stdout, timed_out = run_streaming(cmd, args.timeout_s)
        tests = parse_junit(junit) if junit.exists() else []
        # the command less its temporary files: the JUnit report, a shard's list (`shard_tests`)
        shown = [{f"--only-tests={tmp / 'shard_tests.txt'}": "--only-tests=<shard_tests>"}.get(a, a)
                 for a in cmd if a != f"--junitxml={junit}"]  # fmt: skip
    lines = [line for line in stdout.splitlines() if line.strip()]
    result = {
        **provenance([sys.executable, *sys.argv] if argv is sys.argv[1:] else argv),
        "pytest_command": shown,
        "pytest_rc": returncode,
        "timed_out": timed_out,
        "summary": lines[-1] if lines else "",
        **sharding,
        "tests": tests,
        "failures": stdout[-6000:] if returncode else "",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
