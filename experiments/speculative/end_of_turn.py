"""Tokens per verification (τ) before and after the end of a reply's turn, at batch 1.

The speculative benchmark (`run.py`) decodes every request to --max-tokens with `ignore_eos`,
so a chat reply that ends its turn early goes on with what the model writes past its own end
(another turn, a restart), text a draft head trained on replies that stop there never saw.
This runs one method on the benchmark's prompts one request at a time (a decode scan then holds
one sequence, so each scan's verifications belong to it), finds where each output first emits
an end-of-sequence token, and splits τ there, each scan placed at the output position it starts
from: before the end, after it, and in the replies that never end (a small model's greedy
replies often loop to the limit). Also τ by output position.

    python experiments/speculative/end_of_turn.py --model smollm2 --method eagle:eagle-smollm2 \
        --requests 32 --out experiments/results/cpu/speculative_end_of_turn.json     # CPU, ~7 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.metrics.summary import summarize
from jaxinfer.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run.py, also when loaded by a test
from run import KINDS, prompts_of, speculative_config


def verifications(records) -> list[tuple[int, int, int]]:
    """One sequence's run (its engine's step records, alone in the batch) as (output tokens
    before the step, verifications, drafts kept) for each step that verified drafts."""
    out, made = [], 0
    for r in records:
        v = sum(r.accepted_hist or [])
        if v:
            out.append((made, v, r.accepted_draft_tokens))
            made += v + r.accepted_draft_tokens
        else:
            made += r.decode_steps
    return out


def tau(steps) -> dict:
    """τ of (position, verifications, kept) steps, with their verifications."""
    v = sum(s[1] for s in steps)
    return {"tau": round((v + sum(s[2] for s in steps)) / v, 3) if v else None, "verifications": v}


def split(requests: list[dict], bin_tokens: int) -> dict:
    """τ over every request; of the replies that end, before and after their end; of those that
    do not; and by output position in bins of `bin_tokens`."""
    ended = [r for r in requests if r["end_of_turn"] is not None]
    steps = [s for r in requests for s in r["steps"]]
    top = max((s[0] for s in steps), default=0)
    return {
        "all": tau(steps),
        "ended": len(ended),
        "before_end": tau([s for r in ended for s in r["steps"] if s[0] < r["end_of_turn"]]),
        "after_end": tau([s for r in ended for s in r["steps"] if s[0] >= r["end_of_turn"]]),
        "never_ended": tau([s for r in requests if r["end_of_turn"] is None for s in r["steps"]]),
        "by_position": {f"{lo}-{lo + bin_tokens}": tau([s for s in steps
                                                        if lo <= s[0] < lo + bin_tokens])
                        for lo in range(0, top + 1, bin_tokens)},
    }  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="eagle:eagle-smollm2")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--workload", default="chat", choices=KINDS)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--snippet-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--bin-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        spec = speculative_config(args.method, args.num_draft_tokens)
    except ValueError as e:
        ap.error(f"--method: {e}")
    if spec["method"] == "none":
        ap.error("--method: none verifies no drafts")
    result = {**provenance(), "args": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(args).items()}}  # fmt: skip
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, max_num_batched_tokens=512,
              max_model_len=1024, page_size=16, decode_steps=args.decode_steps,
              decode_buckets=[1], speculative=spec)  # fmt: skip
    eng, eos = llm.engine, set(llm.engine.eos_ids)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    requests, records = [], []
    for i, prompt in enumerate(prompts_of(args.workload, llm, args.requests, args.snippet_chars)):
        t0 = time.perf_counter()
        eng.step_records.clear()
        seq = eng.add_request(prompt, sampling)
        while eng.has_unfinished():
            eng.step()
        if seq.error is not None:
            raise RuntimeError(f"request {i} failed: {seq.error}")
        out = list(seq.output_token_ids)
        eng.release([seq])
        end = next((j for j, t in enumerate(out) if t in eos), None)
        requests.append({"end_of_turn": end, "tokens": len(out),
                         "steps": verifications(eng.step_records)})  # fmt: skip
        records += eng.step_records
        print(f"request {i}: end of turn at {end}, {tau(requests[-1]['steps'])} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    result["summary"] = split(requests, args.bin_tokens)
    # the engine's own account of the same steps: what `all` must equal
    result["engine_tokens_per_verification"] = summarize([], records)["tokens_per_verification"]
    result["requests"] = requests
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
