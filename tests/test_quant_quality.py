"""experiments/quant_quality/run.py: a tiny run scores the reference against itself as lossless,
a 4-bit format as lossy and an 8-bit one as closer, on heldout_perplexity's own windows; the
seeds' claims are judged from the measured change."""

from __future__ import annotations

import json
import math

import experiment_scripts
import pytest
from spine_parts import jaxinfer_formats

from jaxinfer.train.evaluate import heldout_perplexity

ROW_FIELDS = {"model", "format", "perplexity", "nats_per_token", "ppl_change_pct", "kl_mean",
              "heldout_top1_agreement", "greedy_agreement", "greedy_first_disagreement_mean",
              "weight_rel_rms_error", "weight_exact_fraction", "claims"}  # fmt: skip


@pytest.fixture(scope="module")
def qq():
    return experiment_scripts.load("quant_quality/run")


@pytest.fixture(scope="module")
def tiny_run(qq, tmp_path_factory):
    out = tmp_path_factory.mktemp("qq") / "quant_quality.json"
    result = qq.main(["--models", "tiny", "--formats", "int4_g128_asym", "q8_0",
                      "--num-prompts", "2", "--gen-tokens", "8", "--max-windows", "2",
                      "--out", str(out), "--plot", str(out.with_suffix(".png"))])  # fmt: skip
    return result, out


def test_tiny_run_rows_have_every_metric_and_the_file_matches(tiny_run):
    result, out = tiny_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["format"] for r in result["rows"]] == ["none", "int4_g128_asym", "q8_0"]
    for row in result["rows"]:
        assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
    assert result["settings"]["max_windows"] == 2 and result["dtype"] == "float32"
    assert result["models"]["tiny"]["heldout_tokens_scored"] == 2 * 256
    for key in ("device", "jax", "commit", "date", "command"):
        assert result[key]


def test_reference_row_is_lossless_and_a_4bit_format_is_not(tiny_run):
    rows = {r["format"]: r for r in tiny_run[0]["rows"]}
    ref, int4, q8 = rows["none"], rows["int4_g128_asym"], rows["q8_0"]
    assert abs(ref["kl_mean"]) <= 1e-7 and ref["ppl_change_pct"] == 0
    assert ref["greedy_agreement"] == 1.0 and ref["greedy_first_disagreement_mean"] == 8
    assert ref["weight_rel_rms_error"] == 0
    assert int4["kl_mean"] > 1e-4 and int4["weight_rel_rms_error"] > 0.01
    assert int4["ppl_change_pct"] != 0
    assert 0 < q8["kl_mean"] < int4["kl_mean"]  # 8-bit blocks of 32 are closer than 4-bit
    assert q8["weight_rel_rms_error"] < int4["weight_rel_rms_error"]
    for row in rows.values():
        assert 0 <= row["greedy_agreement"] <= 1
        assert 0 <= row["greedy_first_disagreement_mean"] <= 8
        change = 100 * math.expm1(row["nats_per_token"] - ref["nats_per_token"])
        assert row["ppl_change_pct"] == pytest.approx(change, abs=1e-3)


def test_reference_perplexity_is_heldout_perplexitys_on_the_same_windows(tiny_run):
    ref = tiny_run[0]["rows"][0]
    plain = heldout_perplexity("tiny", text="code", max_windows=2, show_progress=False)
    assert plain["heldout_tokens"] == tiny_run[0]["models"]["tiny"]["heldout_tokens_scored"]
    assert ref["nats_per_token"] == pytest.approx(plain["nats_per_token"], abs=2e-4)


def test_claim_verdicts_follow_the_claimed_ranges(qq):
    def verdicts(fmt, change):
        return {(c["seed"][:3], c["verdict"]) for c in qq.claim_verdicts(fmt, change)}

    assert verdicts("int8", 0.7) == {("004", "inside"), ("002", "above")}  # <1% and <0.5%
    assert verdicts("fp8_block", -0.2) == {("004", "inside"), ("002", "inside")}
    assert verdicts("int4_g128_sym", 0.5) == {("004", "below"), ("002", "below")}
    assert verdicts("int4_g128_sym", 2.0) == {("004", "inside"), ("002", "inside")}
    assert verdicts("nvfp4", 6.0) == {("004", "above")}
    # each of the package's formats is claimed (the script's FORMATS is the registry's at its
    # import, which a test's format registered at that moment would join)
    ours = [f for f in qq.FORMATS if f != "none" and f in jaxinfer_formats()]
    assert len(ours) == 11 and all(qq.claim_verdicts(f, 0.0) for f in ours), ours
