"""The mixed-step attention benchmark runs on the CPU (interpret mode): a kernel configuration and
XLA agree with its reference, and that reference with attention written out sequence by sequence.
(One kernel configuration: each is an interpreted kernel; both, split decode rows or not, are
checked on mixed steps in tests/test_paged_attention_kernel.py.)"""

from __future__ import annotations

import json

import experiment_scripts
import jax
import numpy as np
from test_paged_attention_reference import naive_attention

from pallas_kernels.paged_attention import paged_attention


def walk_pages(pages, table, seq_lens):
    """Each sequence's keys (or values) in position order, read slot by slot through its table."""
    page_size = pages.shape[1]
    out = []
    for s, n in enumerate(seq_lens):
        pos = np.arange(n)
        out.append(pages[table[s, pos // page_size], pos % page_size])
    return out


def test_smoke_rows_agree_with_a_reference_that_agrees_with_attention_per_sequence(
    tmp_path, monkeypatch
):
    module = experiment_scripts.load("bench_mixed_attention")
    # The benchmark's yardstick is its one eager call (the variants run under jit): keep it.
    yardsticks = []

    def spy(*args, **kw):
        out = paged_attention(*args, **kw)
        if not isinstance(out, jax.core.Tracer):
            yardsticks.append(np.asarray(out, np.float32))
        return out

    monkeypatch.setattr(module, "paged_attention", spy)
    out = tmp_path / "mixed.json"
    module.main(["--smoke", "--no-timing", "--variants", "pallas_split", "xla", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "rows", "kv_bytes"):
        assert key in result, key
    n = result["query_tokens"]
    assert n == 2 + 20  # two decode rows and a 20-token chunk
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"pallas_split", "xla"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["rel_err"] < 1e-2, r

    # The rows' errors are against the yardstick; the yardstick against float64 attention over
    # keys gathered slot by slot, sharing no code with the backends: a bug common to the kernel
    # and the XLA path (the dispatcher's softmax scale, say) shows here, never in the rows.
    (ref,) = yardsticks
    step, _ = module.make_step(module.parse_args(["--smoke"]))  # the same inputs (seed 0)
    q, k_pages, v_pages = (np.asarray(x, np.float32) for x in step[:3])
    table, seq_lens, qsl = map(np.asarray, step[3:])
    want = naive_attention(q, qsl, walk_pages(k_pages, table, seq_lens),
                           walk_pages(v_pages, table, seq_lens))[:n]  # fmt: skip
    err = np.linalg.norm(ref[:n] - want) / np.linalg.norm(want)
    assert err < 1e-2, f"the benchmark's reference is off attention by {err:.2e}"
