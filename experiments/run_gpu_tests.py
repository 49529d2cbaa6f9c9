"""Run `-m gpu` tests and record what passed, with provenance: the results file of a GPU
correctness run (`experiments/results/h200/gpu_tests_<name>.json`).

    python experiments/run_gpu_tests.py --out $OUT/gpu_tests.json -- tests/test_gpu_engine.py -k bf16

Everything after `--` goes to pytest (`-m gpu -q` and a JUnit report are added). The file holds
each test's outcome and seconds, pytest's summary line and exit code; it is written even when
tests fail (the exit code is pytest's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rows.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0))})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(ours)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={junit}",
               *pytest_args]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        tests = parse_junit(junit) if junit.exists() else []
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result = {
        **provenance([sys.executable, *sys.argv] if argv is sys.argv[1:] else argv),
        "pytest_command": cmd[:5] + cmd[6:],
        "pytest_rc": proc.returncode,
        "summary": lines[-1] if lines else "",
        "tests": tests,
        "failures": proc.stdout[-6000:] if proc.returncode else "",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(result["summary"])
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
