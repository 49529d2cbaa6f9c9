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
