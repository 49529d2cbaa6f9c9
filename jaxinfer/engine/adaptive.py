"""Adaptive speculation (`engine.speculative.adaptive`): before each decode scan, choose the
speculative path (drafts verified each round) or the plain one (one token per row per round),
whichever has been making more tokens per second at this batch size.

Speculation pays while a verification of 1 + gamma rows costs less than the tokens it keeps:
small batches on a memory-bound device, drafts that are accepted. A large batch (compute-bound)
or drafts that are rejected turn it into a loss. So the engine measures both paths: per decode
bucket (the scan's rows), an exponentially weighted mean (EWMA) of each path's output tokens
per second of scan time, and runs the faster: speculation only where its rate beats plain's by
`MARGIN`, since what it costs outside the scans (below) is not in them. The slower one gets one
scan in every N (a probe), so a shift in acceptance (a new workload) is noticed. A bucket starts
by probing both, twice each: a path's first scan in a bucket is a warm-up, not measured (the
first decode scan of a batch ran 2-2.5x as long as the scans after it in an H100 trace, whichever
path it took: measured, it held speculation at half its rate and out of a batch-8 bucket for 29
scans of 124, h100/speculative_processes.json).

A probe costs what the losing path loses over its own scan: (its scan seconds / the winner's)
x (1 - its rate / the winner's), in winner scans. N is that over `budget` (1%), at least
`probe_every` and at most `max_probe_every`: a loser close behind is probed every 16 scans, a
far one (speculation at 0.5x with scans twice as long, a large batch) every 100, so probes
never cost more than ~1% of throughput where they can be afforded (a fixed 1 in 16 would cost
such a loser 6%), and a shift is still seen within 128 scans. The policy is pure host
bookkeeping (a few dict operations per scan) and knows nothing of clocks: the engine hands it
tokens and seconds, which tests can fake.
"""

from __future__ import annotations

import math

# The loser's probes: one scan in at least 16 (a shift is seen within 128 rounds at the default
# decode_steps of 8) and at most 128, as far apart as keeps their cost to BUDGET.
PROBE_EVERY = 16
MAX_PROBE_EVERY = 128
BUDGET = 0.01
# Speculation wins a bucket only where its scans make tokens at least this much faster than plain
# ones: speculating has a cost outside the scans. Plain decoding keeps a wave of equal-length
# requests in step; speculation desynchronises it, and the admissions that follow come one at a
# time, each a mixed step in which the decode rows advance one token. On the H200 at 64 rows
# (SmolLM2, h200/speculative_b64_256.json) EAGLE's scans were 1.6% faster than plain's while its
# mixed steps took 8% of the wall time more (193 against 166): the policy chose speculation in
# 73% of the scans and lost 19% (speculative_adaptive_b64_256.json).
MARGIN = 0.10
# The weight of a path's newest measurement when it also ran the scan before: a scan's rate is
# noisy (host scheduling, sequences ending inside it); 0.3 follows a change within ~4 scans.
ALPHA = 0.3
# The engine reports only scans whose sequences were live in at least this share of their
# row-rounds: a scan thinned by sequences ending inside it (a batch's tail) costs less host work
# for its fewer tokens, and its rate scaled to the full bucket reads as a faster path (in an
# H200 trace, tail scans read 3-8x any full scan's rate and kept a losing path in use).
MIN_LIVE = 0.75


class AdaptiveSpeculation:
    """Which path the next decode scan of a bucket runs (`speculate`), from what the engine
    reports: each dispatch (`dispatched`) and each scan's tokens over its seconds (`record`)."""

    def __init__(self, probe_every: int = PROBE_EVERY, alpha: float = ALPHA,
                 max_probe_every: int = MAX_PROBE_EVERY, budget: float = BUDGET,
                 margin: float = MARGIN) -> None:  # fmt: skip
        if (probe_every < 2 or max_probe_every < probe_every or not 0 < alpha <= 1 or budget <= 0
                or margin < 0):  # fmt: skip
            raise ValueError(f"probe_every={probe_every} must be >= 2 and <= max_probe_every="
                             f"{max_probe_every}, alpha={alpha} in (0, 1], budget={budget} > 0, "
                             f"margin={margin} >= 0")  # fmt: skip
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.alpha, self.budget, self.margin = alpha, budget, margin
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> tokens/s EWMA
        self.seconds: dict[tuple[int, bool], float] = {}  # -> seconds a scan, EWMA
        self._scans: dict[int, int] = {}  # scans dispatched per bucket
        self._last: dict[tuple[int, bool], int] = {}  # (bucket, path) -> its latest scan's index
        self._dispatches: dict[tuple[int, bool], int] = {}  # (bucket, path) -> scans dispatched
        self._recorded: dict[tuple[int, bool], int] = {}  # (bucket, path) -> _scans at its record
        # when a list: each record as (scan index, bucket, speculative, its tok/s, its seconds,
        # the speculative and plain EWMAs after it): how the policy got where it is
        self.log: list[tuple] | None = None

    def speculate(self, bucket: int) -> bool:
        """Whether the next scan of `bucket` rows should speculate (no side effect: asking
        twice gives the same answer)."""
        missing = [p for p in (True, False) if (bucket, p) not in self.rate]
        if missing:  # probe the unmeasured path with the fewest scans so far, speculation first
            return min(missing, key=lambda p: self._dispatches.get((bucket, p), 0))
        best = self._speculation_wins(bucket)
        since = self._scans[bucket] - self._last[bucket, not best]  # the winner's scans since
        return best if since + 1 < self.probe_interval(bucket) else not best

    def measured_faster(self, bucket: int) -> bool:
        """Whether speculation has been measured the faster path of `bucket`: what mixed steps
        follow. They are neither measured nor probes, so a batch size that decode scans have not
        yet measured on both paths drafts nothing in its mixed steps (a server that admits a
        request every few steps would otherwise verify drafts in every mixed step of a batch
        size where speculation loses, as long as its decode scans were too few to find out)."""
        measured = all((bucket, p) in self.rate for p in (True, False))
        return measured and self._speculation_wins(bucket)

    def _speculation_wins(self, bucket: int) -> bool:
        return self.rate[bucket, True] > (1 + self.margin) * self.rate[bucket, False]

    def probe_interval(self, bucket: int) -> int:
        """N: the losing path of `bucket` runs one scan in N (both paths measured). A plain
        winner within the margin of speculation's rate gives up no rate to its probes: N is
        `probe_every` there."""
        best = self._speculation_wins(bucket)
        win, lose = (bucket, best), (bucket, not best)
        if self.rate[win] <= 0:  # neither path has made a token yet
            return self.probe_every
        cost = self.seconds[lose] / self.seconds[win] * max(1 - self.rate[lose] / self.rate[win], 0)
        return min(max(self.probe_every, math.ceil(cost / self.budget)), self.max_probe_every)

    def dispatched(self, bucket: int, speculative: bool) -> None:
        """A scan of `bucket` on that path was dispatched (counted here, not when it is read,
        so a chained scan dispatched before its predecessor is read does not probe again)."""
        n = self._scans.get(bucket, 0) + 1
        self._scans[bucket] = n
        self._last[bucket, speculative] = n
        self._dispatches[bucket, speculative] = self._dispatches.get((bucket, speculative), 0) + 1

    def record(self, bucket: int, speculative: bool, tokens: float, seconds: float) -> None:
        """A scan of that path made `tokens` output tokens in `seconds` of wall time (the engine
        scales them to every row of the bucket live in every round, `Engine._measure`). The EWMA
        runs over the bucket's scans: a measurement after `gap` scans of the other path weighs
        what `gap` consecutive ones would, 1 - (1 - alpha)^gap, so a probe's fresh rate all but
        replaces a stale one (one probe notices a shift). The path's first scan reported in the
        bucket is its warm-up: logged, not measured."""
        if seconds <= 0:
            return
        key, rate, now = (bucket, speculative), tokens / seconds, self._scans.get(bucket, 0)
        if key not in self._recorded:  # the path's warm-up in this bucket: not measured
            pass
        elif key not in self.rate:
            self.rate[key], self.seconds[key] = rate, seconds
        else:
            weight = 1 - (1 - self.alpha) ** max(now - self._recorded[key], 1)
            self.rate[key] += weight * (rate - self.rate[key])
            self.seconds[key] += weight * (seconds - self.seconds[key])
        self._recorded[key] = now
        if self.log is not None:
            self.log.append((now, bucket, speculative, rate, seconds, self.rate.get((bucket, True)),
                             self.rate.get((bucket, False))))  # fmt: skip
