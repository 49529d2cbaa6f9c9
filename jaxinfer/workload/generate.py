"""Synthetic workloads: random prompt token ids with lengths and arrivals from distributions.

Independent random streams (spawned from one seed) draw prompt lengths, output lengths, arrival
times and token ids, so changing e.g. the arrival rate leaves the prompts unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxinfer.workload.arrivals import AllAtOnce, ArrivalProcess
from jaxinfer.workload.lengths import LengthDist
from jaxinfer.workload.request import WorkloadRequest


def _streams(seed: int) -> list[np.random.Generator]:
    """Generators for: prompt lengths, output lengths, arrivals, token ids."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: must be an int >= 0")
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]


def allowed_token_ids(vocab_size: int, avoid_ids: Iterable[int] = ()) -> np.ndarray:
    """The ids in [0, vocab_size) not in `avoid_ids` (ids outside the range are ignored)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid: must be an int >= 1")
    avoid = np.fromiter((int(t) for t in avoid_ids), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), avoid)
    if allowed.size == 0:
        raise ValueError(f"avoid_ids excludes every id of the vocabulary (size {vocab_size})")
    return allowed


def _check_n(num_requests: int) -> None:
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r} is invalid: must be an int >= 1")


def synthetic_requests(
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    *,
    vocab_size: int,
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    avoid_ids: Iterable[int] = (),
) -> list[WorkloadRequest]:
    """`num_requests` prompts of uniformly random token ids (never one of `avoid_ids`)."""
    _check_n(num_requests)
    r_plen, r_olen, r_arr, r_tok = _streams(seed)
    allowed = allowed_token_ids(vocab_size, avoid_ids)
    plens = prompt_len.sample(r_plen, num_requests)
    olens = output_len.sample(r_olen, num_requests)
    times = (arrivals or AllAtOnce()).sample(r_arr, num_requests)
    tokens = allowed[r_tok.integers(0, allowed.size, size=int(plens.sum()))]
    starts = np.concatenate([[0], np.cumsum(plens)])
    return [
        WorkloadRequest(
            prompt_token_ids=tokens[starts[i] : starts[i + 1]].tolist(),
            prompt=None,
            output_len=int(olens[i]),
            arrival_time=float(times[i]),
        )
        for i in range(num_requests)
    ]


def shared_prefix_requests(
    num_requests: int,
    system_prompt_len: int,
    suffix_len: LengthDist,
    output_len: LengthDist,
    *,
    vocab_size: int,
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    avoid_ids: Iterable[int] = (),
) -> list[WorkloadRequest]:
    """Every prompt is one random system prefix of `system_prompt_len` tokens + a random suffix."""
    if (
        isinstance(system_prompt_len, bool)
        or not isinstance(system_prompt_len, int)
        or system_prompt_len < 1
    ):
        raise ValueError(f"system_prompt_len={system_prompt_len!r} is invalid: must be an int >= 1")
    _check_n(num_requests)
    reqs = synthetic_requests(
        num_requests,
        suffix_len,
        output_len,
        vocab_size=vocab_size,
        arrivals=arrivals,
        seed=seed,
        avoid_ids=avoid_ids,
    )
    # The prefix comes from its own stream (a fifth child of the seed), so suffixes don't move.
    prefix_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])
    allowed = allowed_token_ids(vocab_size, avoid_ids)
    prefix = allowed[prefix_rng.integers(0, allowed.size, size=system_prompt_len)].tolist()
    for r in reqs:
        assert r.prompt_token_ids is not None
        r.prompt_token_ids = prefix + r.prompt_token_ids
    return reqs


def multi_turn_requests(
    num_requests: int,
    num_turns: int,
    user_len: LengthDist,
    output_len: LengthDist,
    *,
    turn_gap_s: float,
    system_prompt_len: int = 0,
    vocab_size: int,
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    avoid_ids: Iterable[int] = (),
) -> list[WorkloadRequest]:
    """Chat conversations of `num_turns` turns (the last one cut at `num_requests` requests),
    sorted by arrival. Turn t's prompt is the conversation so far (a system prompt of
    `system_prompt_len` tokens shared by every conversation, then each earlier user message and
    reply) plus a new user message of `user_len` tokens; it arrives `turn_gap_s` after turn t - 1,
    the conversations' first turns at `arrivals`. A reply is `output_len` random tokens standing
    for the model's: a static workload cannot know the model's reply, so a prefix cache can hit
    every earlier turn's prompt but not the reply the engine generated (a live chat resends the
    model's own reply, whose pages the cache registered as it wrote them: it would hit more)."""
    _check_n(num_requests)
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1:
        raise ValueError(f"num_turns={num_turns!r} is invalid: must be an int >= 1")
    if not isinstance(turn_gap_s, int | float) or not (np.isfinite(turn_gap_s) and turn_gap_s >= 0):
        raise ValueError(f"turn_gap_s={turn_gap_s!r} is invalid: must be a finite number >= 0")
    if (
        isinstance(system_prompt_len, bool)
        or not isinstance(system_prompt_len, int)
        or (system_prompt_len < 0)
    ):
        raise ValueError(f"system_prompt_len={system_prompt_len!r} is invalid: must be an int >= 0")
    r_plen, r_olen, r_arr, r_tok = _streams(seed)
    allowed = allowed_token_ids(vocab_size, avoid_ids)
    conversations = -(-num_requests // num_turns)
    starts = (arrivals or AllAtOnce()).sample(r_arr, conversations)
    prefix_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])
    system = allowed[prefix_rng.integers(0, allowed.size, size=system_prompt_len)].tolist()

    def tokens(n: int) -> list[int]:
        return allowed[r_tok.integers(0, allowed.size, size=n)].tolist()

    reqs: list[WorkloadRequest] = []
    for c in range(conversations):
        history = list(system)
        for t in range(min(num_turns, num_requests - len(reqs))):
            history += tokens(int(user_len.sample(r_plen, 1)[0]))
            out = int(output_len.sample(r_olen, 1)[0])
            reqs.append(
                WorkloadRequest(list(history), None, out, float(starts[c] + t * turn_gap_s))
            )
            history += tokens(out)  # the stand-in reply
    return sorted(reqs, key=lambda r: r.arrival_time)
