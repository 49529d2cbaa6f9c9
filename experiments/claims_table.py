"""The claims table of experiments/README.md: each claim's headline figure from a results folder.

    python experiments/claims_table.py experiments/results/h200 --column H200
    python experiments/claims_table.py experiments/results/cpu --column CPU --check

`--column` picks the table column whose header starts with that text. Without `--check` its cells
are rewritten from the results and the plots column gets a link, labelled with the column's name,
to each claim's report; a claim without results keeps its cells. With `--check` nothing is
written: it exits 1 unless every cell already is the figure the results give.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jaxinfer.experiment.report import Point, load_points

README = Path(__file__).with_name("README.md")


def _points(sweep: Path, key: str) -> dict:
    """{value of `key`: Point} of a sweep folder's finished points."""
    if not sweep.is_dir():
        return {}
    points, _ = load_points([sweep])
    return {p.params.get(key): p for p in points}


def _change(new: float, old: float) -> str:
    pct = round(100 * (new / old - 1))
    return f"+{pct}%" if pct >= 0 else f"−{-pct}%"


def _m(p: Point, key: str) -> float:
    return float(p.metrics[key])


def continuous_vs_static(results: Path) -> str | None:
    pts = _points(results / "continuous_vs_static", "engine.scheduler")
    if not {"fcfs", "static"} <= set(pts):
        return None
    a, b = _m(pts["fcfs"], "output_throughput"), _m(pts["static"], "output_throughput")
    return f"**{a / b:.2f}×** output tok/s ({a:,.0f} vs {b:,.0f})"


def paged_vs_contiguous(results: Path) -> str | None:
    pts = _points(results / "paged_vs_contiguous", "engine.allocation")
    if not {"on_demand", "reserve_max"} <= set(pts):
        return None
    paged, contiguous = pts["on_demand"], pts["reserve_max"]
    wp, wc = (100 * _m(p, "wasted_slot_fraction_mean") for p in (paged, contiguous))
    cp, cc = _m(paged, "mean_num_seqs"), _m(contiguous, "mean_num_seqs")
    return (
        f"waste **{wp:.1f}% vs {wc:.1f}%**; concurrency **{cp / cc:.1f}×** ({cp:.1f} vs {cc:.1f})"
    )


def vs_transformers(results: Path) -> str | None:
    path = results / "vs_transformers.json"
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    if "speedup_vs_best_transformers" not in r:  # transformers did not finish
        return None
    ours = r["rows"][0]["output_tok_s"]
    hf = max((x for x in r["rows"] if x["impl"] == "transformers"), key=lambda x: x["output_tok_s"])
    return (
        f"**{r['speedup_vs_best_transformers']:.2f}×** ({ours:,.0f} vs {hf['output_tok_s']:,.0f} "
        f"tok/s, HF at batch {hf['batch_size']})"
    )


def chunked_prefill(results: Path) -> str | None:
    pts = _points(results / "chunked_prefill", "engine.chunked_prefill")
    if not {True, False} <= set(pts):
        return None
    on, off = pts[True], pts[False]
    ttft = _change(_m(on, "ttft_median"), _m(off, "ttft_median"))
    tput = _change(_m(on, "total_token_throughput"), _m(off, "total_token_throughput"))
    itl = _change(_m(on, "itl_p99"), _m(off, "itl_p99"))
    return f"TTFT p50 **{ttft}**, throughput **{tput}**; ITL p99 {itl}"


def prefix_caching(results: Path) -> str | None:
    sweep = results / "prefix_caching"
    if not sweep.is_dir():
        return None
    points, _ = load_points([sweep])
    by = {(p.params.get("engine.prefix_caching"), p.params.get("engine.scheduler")): p
          for p in points}  # fmt: skip
    if not {(False, "fcfs"), (True, "fcfs")} <= set(by):
        return None
    on, off = by[(True, "fcfs")], by[(False, "fcfs")]
    ttft = _change(_m(on, "ttft_median"), _m(off, "ttft_median"))
    p99 = _change(_m(on, "ttft_p99"), _m(off, "ttft_p99"))
    work = _change(_m(on, "device_ms_mean") * _m(on, "num_steps"),
                   _m(off, "device_ms_mean") * _m(off, "num_steps"))  # fmt: skip
    hit = 100 * _m(on, "prefix_cache_hit_rate")
    return (
        f"TTFT p50 **{ttft}**, p99 {p99}; device time **{work}**; {hit:.0f}% of prompt tokens hit"
    )


def speculative(results: Path) -> str | None:
    path = results / "speculative.json"
    if not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r["method"] != "none"]
    if not rows:
        return None
    batch = min(r["batch"] for r in rows)
    best = max((r for r in rows if r["batch"] == batch), key=lambda r: r["speedup"])
    same = all(r["same_output_as_none"] for r in rows)
    return (f"best at batch {batch}: **{best['speedup']:.2f}×** ({best['method']}, "
            f"{best['workload']}, τ {best['tokens_per_verification']:.2f}); outputs "
            f"{'identical' if same else 'DIFFER'}")  # fmt: skip


@dataclass(frozen=True)
class Claim:
    row: str  # the `#` cell of its table row
    name: str  # its experiment folder
    figure: Callable[[Path], str | None]
    link: str  # its report (or results file), relative to the results folder


CLAIMS = (
    Claim("1", "continuous_vs_static", continuous_vs_static,
          "continuous_vs_static/report/report.md"),
    Claim("2", "paged_vs_contiguous", paged_vs_contiguous, "paged_vs_contiguous/report/report.md"),
    Claim("3", "vs_transformers", vs_transformers, "vs_transformers.json"),
    Claim("4", "chunked_prefill", chunked_prefill, "chunked_prefill/report/report.md"),
    Claim("5", "prefix_caching", prefix_caching, "prefix_caching/report/report.md"),
    Claim("6", "speculative", speculative, "speculative.json"),
)  # fmt: skip
LINKS_COLUMN = "plots"
_LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> tuple[list[str], list[int]]:
    """(header cells, line indices of the body rows) of the claims table."""
    for i, line in enumerate(lines):
        if re.match(r"\|\s*#\s*\|", line):
            body = range(i + 2, len(lines))
            end = next((j for j in body if not lines[j].startswith("|")), len(lines))
            return _cells(line), list(range(i + 2, end))
    raise ValueError("no claims table (a header row starting with `| # |`)")


def _col(heads: list[str], name: str) -> int:
    for i, h in enumerate(heads):
        if h.startswith(name):
            return i
    raise ValueError(f"no column starting with {name!r} in {heads}")


def _with_link(cell: str, label: str, target: str) -> str:
    """The links cell with `[label](target)` replaced or appended (` · ` between links)."""
    links = dict(_LINK.findall(cell))
    links[label] = target
    return " · ".join(f"[{k}]({v})" for k, v in links.items())


def column(text: str, name: str) -> dict[str, str]:
    """{`#`: cell} of the table column whose header starts with `name`."""
    lines = text.splitlines()
    heads, body = _table(lines)
    col = _col(heads, name)
    return {(row := _cells(lines[i]))[0]: row[col] for i in body}


def fill(text: str, name: str, figures: dict[str, str], links: dict[str, str]) -> str:
    """The README text with column `name`'s cell of each row in `figures` (keyed by `#`) replaced,
    and a link labelled `name` to `links[#]` in the plots column."""
    lines = text.splitlines(keepends=True)
    heads, body = _table(lines)
    col, link_col, label = _col(heads, name), _col(heads, LINKS_COLUMN), name.split()[0]
    for i in body:
        row = _cells(lines[i])
        if row[0] in figures:
            row[col] = figures[row[0]]
            row[link_col] = _with_link(row[link_col], label, links[row[0]])
            lines[i] = "| " + " | ".join(row) + " |\n"
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="e.g. experiments/results/h200")
    ap.add_argument("--column", required=True, help="header prefix of the column, e.g. H200")
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    if args.check:
        have, bad = column(text, args.column), 0
        for c in CLAIMS:
            figure = c.figure(args.results)
            ok = figure is not None and have.get(c.row) == figure
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {c.row} {c.name}: results say {figure}")
        return 1 if bad else 0
    figures, links = {}, {}
    for c in CLAIMS:
        figure = c.figure(args.results)
        print(f"{c.row} {c.name}: {figure or 'no results; cell kept'}")
        if figure is not None:
            figures[c.row] = figure
            links[c.row] = os.path.relpath(args.results / c.link, args.readme.parent)
    args.readme.write_text(fill(text, args.column, figures, links))
    return 0


if __name__ == "__main__":
    sys.exit(main())
