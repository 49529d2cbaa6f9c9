"""Back-to-back A/B of `bench_e2e.py` variants on one machine, merged into one results file.

The same benchmark command moves by up to ~4% between machines (`docs/decisions.md`), more
than most of the effects an ablation looks for, so variants are only comparable when they run
back to back on one machine, and interleaved (A B A B ...) so that drift lands on all of them. This runs
`bench_e2e.py` once per (round, variant), each in a process of its own (its own engine and
compiles; pass `--compile-cache ''` in `--common` for cold ones), and writes ONE JSON:

- provenance (device, jax, commit of the runs; date and command of this A/B) and each run's
  command line;
- `decode`: per (batch, context) and variant, step_ms of every round, their mean, and the change
  of the mean against the first variant (`change` = mean / base mean - 1; negative is faster);
- `throughput`: the same for output tok/s per (impl, workload) (positive is faster);
- `warmup_s` per variant and round, errors of any run, and every run's own JSON under `runs`.

    python3 experiments/ab_e2e.py --out $OUT/ab.json --rounds 2 \\
        --common "--parts decode --batches 1 8 --contexts 512 2048 --compile-cache ''" \\
        --variant base= --variant gather="--attention-options token_major_decode=false"

A variant may run another checkout's code (`--tree before=/path/to/checkout@COMMIT`): a before/after
A/B of a change on one machine.

An interrupted A/B resumes: each finished run's JSON stays in `--work` (default: a folder next to
`--out`) with a marker, and is not run again. Each run's console output goes to `<work>/<run>.log`;
this prints one line per run and a table at the end (the device tool returns only the output's
tail).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent / "bench_e2e.py"
PROVENANCE = ("device", "jax", "python", "commit")


def _sets_out(argv: list[str]) -> bool:
    return any(a == "--out" or a.startswith("--out=") for a in argv)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS",
                    help="a variant: its name and the bench_e2e.py arguments it adds to --common "
                         "(shell-quoted); the first one is the base of every change")  # fmt: skip
    ap.add_argument("--common", default="", help="bench_e2e.py arguments of every run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each variant runs, interleaved: A B A B ...")  # fmt: skip
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the runs' JSON and logs (default: <out stem>_runs next to "
                         "--out); finished runs found there are not run again")  # fmt: skip
    ap.add_argument("--python", default=sys.executable, help="interpreter of the runs")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH[@COMMIT]",
                    help="variant NAME runs the bench_e2e.py of another checkout at PATH (its "
                         "code: a before/after A/B), recording COMMIT as its commit")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=None, help="per run")
    args = ap.parse_args(argv)
    variants = {}
    for item in args.variant:
        name, sep, rest = item.partition("=")
        if not sep or not name or not name.replace("_", "").replace("-", "").isalnum():
            ap.error(f"--variant {item!r}: expected NAME=ARGS with a name of letters, digits, "
                     "'-' or '_' (ARGS may be empty: base=)")  # fmt: skip
        if name in variants:
            ap.error(f"--variant {name!r} given twice")
        try:
            variants[name] = shlex.split(rest)
        except ValueError as e:
            ap.error(f"--variant {name}: {e}")
        if _sets_out(variants[name]):
            ap.error(f"--variant {name}: --out is set per run by this script")
    if len(variants) < 2:
        ap.error("give at least two --variant (the first is the base)")
    try:
        args.common_args = shlex.split(args.common)
    except ValueError as e:
        ap.error(f"--common: {e}")
    if _sets_out(args.common_args):
        ap.error("--common: --out is set per run by this script")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.variants = variants
    args.trees = {}
    for item in args.tree:
        name, sep, rest = item.partition("=")
        path, _, commit = rest.partition("@")
        if (
            not sep
            or name not in variants
            or not (Path(path) / "experiments/bench_e2e.py").exists()
        ):
            ap.error(f"--tree {item!r}: expected NAME=PATH[@COMMIT] naming a --variant and a "
                     "checkout with experiments/bench_e2e.py")  # fmt: skip
        args.trees[name] = (Path(path).resolve(), commit or None)
    if args.work is None:
        args.work = args.out.with_name(args.out.stem + "_runs")
    return args


def run_plan(args) -> list[tuple[str, str, int]]:
    """(run name, variant, round) in execution order: rounds outer, variants inner."""
    return [(f"{v}_r{k}", v, k) for k in range(args.rounds) for v in args.variants]


def run_command(args, variant: str, out: Path) -> list[str]:
    bench = BENCH
    if variant in args.trees:
        bench = args.trees[variant][0] / "experiments" / "bench_e2e.py"
    return [args.python, str(bench), "--out", str(out), *args.common_args, *args.variants[variant]]


def run_env(args, variant: str) -> dict[str, str] | None:
    """The environment of a variant's runs: another tree's code first on the path, its commit."""
    if variant not in args.trees:
        return None
    path, commit = args.trees[variant]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
    }
    if commit:
        env["JAXINFER_COMMIT"] = commit
    return env


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def merge(args, runs: dict[str, dict], plan) -> dict:
    """The per-row means and changes against the base variant (see the module docstring)."""
    base = next(iter(args.variants))
    step: dict[tuple, dict[str, list[float]]] = {}
    ratio: dict[tuple, dict[str, list[float]]] = {}
    tput: dict[tuple, dict[str, list[float]]] = {}
    errors = []
    for name, variant, _ in plan:
        r = runs.get(name)
        if r is None:
            continue
        for e in r.get("errors", []):
            errors.append({"run": name, **e})
        for d in r.get("decode", []):
            key = (d["batch"], d["context"])
            if "step_ms" in d:
                step.setdefault(key, {}).setdefault(variant, []).append(d["step_ms"])
                ratio.setdefault(key, {}).setdefault(variant, []).append(d["ratio"])
            else:
                errors.append({"run": name, **d})
        for t in r.get("throughput", []):
            if "output_tok_s" in t and t.get("impl") == "jaxinfer":
                tput.setdefault((t["impl"], t["workload"]), {}).setdefault(variant, []).append(
                    t["output_tok_s"]
                )

    def rows(table: dict, keys: tuple[str, ...], value: str, extra=None) -> list[dict]:
        out = []
        for key, by_variant in table.items():
            base_mean = _mean(by_variant.get(base, []))
            for variant in args.variants:
                xs = by_variant.get(variant, [])
                if not xs:
                    continue
                row = {**dict(zip(keys, key, strict=True)), "variant": variant,
                       value: _mean(xs), f"{value}_rounds": xs}  # fmt: skip
                if extra is not None:
                    row.update(extra(key, variant))
                if base_mean and variant != base:
                    row["change"] = round(_mean(xs) / base_mean - 1, 4)
                out.append(row)
        return out

    decode = rows(step, ("batch", "context"), "step_ms",
                  lambda key, v: {"ratio": _mean(ratio[key].get(v, []))})  # fmt: skip
    return {
        "base": base,
        "decode": decode,
        "throughput": rows(tput, ("impl", "workload"), "output_tok_s"),
        "warmup_s": {name: runs[name].get("warmup_s") for name, _, _ in plan if name in runs},
        "errors": errors,
    }


def provenance(runs: dict[str, dict], plan) -> dict:
    """The runs' device, jax, python and commit (the first run's; `mismatch` lists any other)."""
    ordered = [runs[name] for name, _, _ in plan if name in runs]
    out = {k: ordered[0].get(k) if ordered else None for k in PROVENANCE}
    mismatch = {
        k: sorted({str(r.get(k)) for r in ordered})
        for k in PROVENANCE
        if len({str(r.get(k)) for r in ordered}) > 1
    }
    if mismatch:
        out["mismatch"] = mismatch
    return out


def print_table(result: dict, console: Console) -> None:
    base = result["base"]
    table = Table(title=f"decode step ms (mean over rounds), change against {base}")
    for col in ("batch", "context", "variant", "step_ms", "ratio", "change", "rounds"):
        table.add_column(col, justify="right")
    for r in result["decode"]:
        change = f"{100 * r['change']:+.2f}%" if "change" in r else ""
        rounds = " ".join(f"{x:.3f}" for x in r["step_ms_rounds"])
        table.add_row(str(r["batch"]), str(r["context"]), r["variant"], f"{r['step_ms']:.4f}",
                      f"{r['ratio']:.3f}", change, rounds)  # fmt: skip
    console.print(table)
    for r in result["throughput"]:
        change = f" {100 * r['change']:+.2f}%" if "change" in r else ""
        console.print(f"{r['workload']} {r['variant']}: {r['output_tok_s']:.1f} tok/s{change}")
    if result["errors"]:
        console.print(f"errors: {len(result['errors'])} (see the JSON)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    console = Console(width=150)
    args.work.mkdir(parents=True, exist_ok=True)
    plan = run_plan(args)
    runs: dict[str, dict] = {}
    commands: dict[str, str] = {}
    result: dict = {}

    def write() -> None:
        merged = merge(args, runs, plan)
        result.clear()
        result.update({
            **provenance(runs, plan),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
            "variants": {v: shlex.join(a) for v, a in args.variants.items()},
            "common": shlex.join(args.common_args),
            "rounds": args.rounds,
            "run_commands": commands,
            **merged,
            "runs": runs,
        })  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    for name, variant, _ in plan:
        out = args.work / f"{name}.json"
        done = args.work / f"{name}.done"
        cmd = run_command(args, variant, out)
        commands[name] = shlex.join(cmd)
        if done.exists() and out.exists():
            runs[name] = json.loads(out.read_text())
            console.print(f"{name}: finished earlier, kept ({out})")
            continue
        t0 = time.perf_counter()
        with open(args.work / f"{name}.log", "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.timeout_s, env=run_env(args, variant))  # fmt: skip
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.perf_counter() - t0
        if out.exists():  # bench_e2e writes after every row: a failed run keeps what it finished
            runs[name] = json.loads(out.read_text())
        if rc == 0 and out.exists():
            done.write_text(commands[name] + "\n")
        else:
            runs.setdefault(name, {}).setdefault("errors", []).append(
                {
                    "part": "run",
                    "error": f"exit {rc} after {wall:.0f} s"
                    + ("" if out.exists() else ", no results file")
                    + f"; see {name}.log",
                }
            )
        console.print(f"{name}: rc={rc} {wall:.0f} s warmup_s={runs.get(name, {}).get('warmup_s')}")
        write()
    write()
    print_table(result, console)
    return result


if __name__ == "__main__":
    main()
