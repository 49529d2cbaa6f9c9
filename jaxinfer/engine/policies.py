"""Scheduling policies by name (`EngineConfig.scheduler`): the order the scheduler serves
sequences in, and whether it admits new ones while others run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxinfer.engine.request import Sequence


@dataclass(frozen=True)
class Policy:
    """A scheduling policy: an order (smaller key first) and whether it admits while others run."""

    key: Callable[[Sequence], tuple]
    admits_while_running: bool = True
    # admit the waiting sequences with the longest cached prefix first (SGLang's LPM), ties in
    # `key` order; needs engine.prefix_caching
    prefix_first: bool = False


def _arrival(seq: Sequence) -> tuple:
    return (seq.arrival_time, seq.seq_id)


POLICIES: dict[str, Policy] = {
    "fcfs": Policy(_arrival),
    "priority": Policy(lambda s: (s.priority, *_arrival(s))),
    "shortest_first": Policy(lambda s: (s.num_prompt_tokens, *_arrival(s))),
    # The naive baseline: a batch is admitted only when nothing runs, then runs to completion.
    "static": Policy(_arrival, admits_while_running=False),
    "lpm": Policy(_arrival, prefix_first=True),
}
