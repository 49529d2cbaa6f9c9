"""Merge the per-format runs of `experiments/quant_xla_h200.sh` into one results file with a
summary table: stored GB, decode step ms per batch, speedup over the plain (bf16) model, ratio to
the format's own memory roofline, and 128/128 throughput where it was measured.

    python experiments/merge_quant_xla.py OUT_DIR --out experiments/results/h200/quant_xla.json

OUT_DIR holds `quant_xla_<fmt>.json` (bench_e2e decode part), `quant_xla_tput_<fmt>.json`
(throughput part) and `driver_runs.jsonl` (each run's status, or why it was skipped). A format's
summary row reads the decode rows at the first context measured; `speedup_vs_plain_b<B>` is the
plain ("none": --dtype, bf16 on the H200) run's step_ms over this format's at batch B,
`x_roofline_b<B>` bench_e2e's `ratio` (step_ms over the roofline of the format's stored bytes).
Rows follow the driver's order of formats (plain first in it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

PLAIN = "none"


def load_runs(out_dir: Path) -> tuple[dict[str, dict], dict[str, dict], list[dict]]:
    """({format: decode JSON}, {format: throughput JSON}, driver records) found in `out_dir`."""
    decode, throughput, unreadable = {}, {}, []
    for path in sorted(out_dir.glob("quant_xla_*.json")):
        name = path.stem.removeprefix("quant_xla_")
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:  # (a run killed while writing)
            unreadable.append({"part": "merge", "format": name, "status": "unreadable",
                               "reason": f"{path.name}: {e}"})  # fmt: skip
            continue
        fmt = run.get("quant", {}).get("weights", PLAIN)
        (throughput if name.startswith("tput_") else decode)[fmt] = run
    runs = out_dir / "driver_runs.jsonl"
    records = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()] \
        if runs.exists() else []  # fmt: skip
    return decode, throughput, records + unreadable


def decode_at(run: dict | None) -> tuple[int | None, dict[int, dict]]:
    """(the first context of the run's measured decode rows, {batch: row} at that context); rows
    that failed (an `error` and no step_ms) are left out."""
    rows = [r for r in (run or {}).get("decode", []) if "step_ms" in r]
    if not rows:
        return None, {}
    context = rows[0]["context"]
    return context, {r["batch"]: r for r in rows if r["context"] == context}


def summary_rows(decode: dict[str, dict], throughput: dict[str, dict],
                 records: list[dict] = ()) -> list[dict]:  # fmt: skip
    _, plain = decode_at(decode.get(PLAIN))
    batches = sorted({b for run in decode.values() for b in decode_at(run)[1]})
    rows = []
    measured = {*decode, *throughput}
    order = [f for f in dict.fromkeys(r.get("format") for r in records) if f in measured]
    for fmt in [*order, *sorted(measured - set(order))]:
        run = decode.get(fmt) or throughput[fmt]
        quant = run.get("quant", {})
        stored = quant.get("served_param_bytes", quant.get("param_bytes"))
        context, at = decode_at(decode.get(fmt))
        row = {"format": fmt, "stored_gb": None if stored is None else round(stored / 1e9, 3),
               "context": context}  # fmt: skip
        for b in batches:
            r = at.get(b)
            row[f"step_ms_b{b}"] = r["step_ms"] if r else None
            row[f"speedup_vs_plain_b{b}"] = (
                round(plain[b]["step_ms"] / r["step_ms"], 3) if r and b in plain else None
            )
            row[f"x_roofline_b{b}"] = r["ratio"] if r else None
        tput = [t for t in throughput.get(fmt, {}).get("throughput", []) if "output_tok_s" in t]
        row["output_tok_s"] = tput[0]["output_tok_s"] if tput else None
        runs = [r for r in (decode.get(fmt), throughput.get(fmt)) if r]
        errors = [*not_ok(records, fmt)]
        errors += [e["error"][:200] for r in runs for e in [*r.get("errors", []), *r["decode"]]
                   if "error" in e]  # fmt: skip
        if errors:
            row["errors"] = list(dict.fromkeys(errors))
        rows.append(row)
    for fmt in dict.fromkeys(r.get("format") for r in records if r.get("format") not in measured):
        rows.append({"format": fmt, "errors": not_ok(records, fmt)})
    return rows


def not_ok(records: list[dict], fmt: str) -> list[str]:
    """The driver's runs of `fmt` that did not finish: failed, timed out or skipped, and why."""
    return [f"{r['part']}: {r['status']} (rc {r.get('rc')}) {r.get('reason', '')}".strip()
            for r in records if r.get("format") == fmt and r.get("status") != "ok"]  # fmt: skip


def print_summary(rows: list[dict], console: Console) -> None:
    columns = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "errors"]
    t = Table(title="weight formats on XLA: decode step and throughput", title_justify="left")
    for c in columns:
        t.add_column(c, justify="left" if c == "format" else "right")
    for r in rows:
        t.add_row(*("-" if r.get(c) is None else str(r[c]) for c in columns))
    console.print(t)
    for r in rows:
        for e in r.get("errors", []):
            console.print(f"{r['format']}: {e}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    decode, throughput, records = load_runs(args.out_dir)
    if not decode and not throughput:
        ap.error(f"{args.out_dir}: no quant_xla_*.json runs")
    first = next(iter([*decode.values(), *throughput.values()]))
    driver = args.out_dir / "driver.json"  # the driver's command, with its settings
    command = json.loads(driver.read_text()).get("command") if driver.exists() else None
    result = {
        **{k: first.get(k) for k in ("device", "jax", "commit", "date", "preset", "dtype")},
        "script": "experiments/quant_xla_h200.sh",
        "command": command,
        "methods": first.get("methods"),
        "summary": summary_rows(decode, throughput, records),
        "driver_runs": records,
        "skipped": [r for r in records if r.get("status") == "skipped"],
        "commits": sorted({str(r.get("commit")) for r in [*decode.values(), *throughput.values()]}),
        "runs": {"decode": decode, "throughput": throughput},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result["summary"], Console(width=200))
    return result


if __name__ == "__main__":
    main()
