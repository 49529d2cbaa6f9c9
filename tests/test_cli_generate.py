"""`jaxinfer generate`: several prompts (flags and files), vLLM's sampling flags, JSON output."""

from __future__ import annotations

import json

from jaxinfer.cli import main
from jaxinfer.engine.loading import load_model
from jaxinfer.generate import greedy_generate

PROMPTS = ["def read(path):\n", "class Stack:\n"]


def run(capsys, *args) -> tuple[int, list[dict]]:
    rc = main(["generate", "--model", "tiny", "--json", "--max-tokens", "6", *args])
    out = capsys.readouterr().out
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_greedy_prompts_give_the_reference_continuations(capsys):
    rc, rows = run(capsys, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--dtype", "float32")
    assert rc == 0 and [r["prompt"] for r in rows] == PROMPTS
    cfg, params, tok = load_model("tiny")
    for row, prompt in zip(rows, PROMPTS, strict=True):
        ids = tok.encode(prompt).ids
        if cfg.bos_token_id is not None and ids[:1] != [cfg.bos_token_id]:
            ids = [cfg.bos_token_id, *ids]
        (want,) = greedy_generate(params, cfg, [ids], 6, eos_token_ids=cfg.eos_token_ids)
        assert row["token_ids"] == want and row["error"] is None
        assert row["text"] == tok.decode(want)


def test_seeded_sampling_from_a_prompts_file_repeats(capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n" + json.dumps({"prompt": "x"}))
    flags = ["--prompts-file", str(path), "--temperature", "0.9", "--top-p", "0.9", "--seed", "7",
             "--dtype", "float32"]  # fmt: skip
    rc, first = run(capsys, *flags)
    assert rc == 0 and [r["prompt"] for r in first] == [*PROMPTS, "x"]
    _, again = run(capsys, *flags)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in first]
    _, other = run(capsys, *flags[:-4], "--seed", "8", "--dtype", "float32")
    assert [r["token_ids"] for r in other] != [r["token_ids"] for r in first]


def test_no_prompt_is_a_one_line_error(capsys):
    assert main(["generate", "--model", "tiny"]) == 2
    assert "give --prompt/--prompts-file or --chat" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "a", "--chat", "b"]) == 2  # not both
    assert "give --prompt/--prompts-file or --chat" in capsys.readouterr().err


def test_engine_overrides_reach_the_engine_and_other_keys_are_refused(capsys):
    rc, rows = run(capsys, "--prompt", "x", "engine.speculative.method=ngram", "--max-model-len",
                   "64", "engine.num_pages=8")  # fmt: skip
    assert rc == 0 and rows[0]["error"] is None and len(rows[0]["token_ids"]) == 6
    assert main(["generate", "--model", "tiny", "--prompt", "x", "max_num_seqs=3"]) == 2
    assert "generate takes engine.KEY=VALUE overrides" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "x", "engine.page_size=0"]) == 2
    assert "engine.page_size=0 is invalid" in capsys.readouterr().err
