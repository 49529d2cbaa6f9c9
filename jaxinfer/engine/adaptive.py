"""Adaptive speculation (`engine.speculative.adaptive`): before each decode scan, choose the
speculative path (drafts verified each round) or the plain one (one token per row per round),
whichever has been making more tokens per second at this batch size.

Speculation pays while a verification of 1 + gamma rows costs less than the tokens it keeps:
small batches on a memory-bound device, drafts that are accepted. A large batch (compute-bound)
or drafts that are rejected turn it into a loss. So the engine measures both paths: per decode
bucket (the scan's rows), an exponentially weighted mean (EWMA) of each path's output tokens
per second of scan time, and runs the faster. The slower one gets one scan in every
`probe_every` (a probe), so a shift in acceptance (a new workload) is noticed. A bucket starts
by probing both. The policy is pure host bookkeeping (a few dict operations per scan) and knows
nothing of clocks: the engine hands it tokens and seconds, which tests can fake.
"""

from __future__ import annotations

# One probe of the losing path per 16 scans costs at most 1/16 of the gap between the paths,
# and a workload shift is seen within 16 scans (128 rounds at the default decode_steps of 8).
PROBE_EVERY = 16
# The weight of a path's newest measurement when it also ran the scan before: a scan's rate is
# noisy (host scheduling, sequences ending inside it); 0.3 follows a change within ~4 scans.
ALPHA = 0.3


class AdaptiveSpeculation:
    """Which path the next decode scan of a bucket runs (`speculate`), from what the engine
    reports: each dispatch (`dispatched`) and each scan's tokens over its seconds (`record`)."""

    def __init__(self, probe_every: int = PROBE_EVERY, alpha: float = ALPHA) -> None:
        if probe_every < 2 or not 0 < alpha <= 1:
            raise ValueError(f"probe_every={probe_every} must be >= 2, alpha={alpha} in (0, 1]")
        self.probe_every, self.alpha = probe_every, alpha
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> tokens/s EWMA
        self._scans: dict[int, int] = {}  # scans dispatched per bucket
        self._last: dict[tuple[int, bool], int] = {}  # (bucket, path) -> its latest scan's index
        self._recorded: dict[tuple[int, bool], int] = {}  # (bucket, path) -> _scans at its record

    def speculate(self, bucket: int) -> bool:
        """Whether the next scan of `bucket` rows should speculate (no side effect: asking
        twice gives the same answer)."""
        missing = [p for p in (True, False) if (bucket, p) not in self.rate]
        if missing:  # probe each path once, speculation first (one not yet dispatched first)
            return ([p for p in missing if (bucket, p) not in self._last] or missing)[0]
        best = self.rate[bucket, True] > self.rate[bucket, False]
        since = self._scans[bucket] - self._last[bucket, not best]  # the winner's scans since
        return best if since + 1 < self.probe_every else not best

    def dispatched(self, bucket: int, speculative: bool) -> None:
        """A scan of `bucket` on that path was dispatched (counted here, not when it is read,
        so a chained scan dispatched before its predecessor is read does not probe again)."""
        n = self._scans.get(bucket, 0) + 1
        self._scans[bucket] = n
        self._last[bucket, speculative] = n

    def record(self, bucket: int, speculative: bool, tokens: float, seconds: float) -> None:
        """A scan of that path made `tokens` output tokens in `seconds` of wall time (the engine
        scales them to every row of the bucket live in every round, `Engine._measure`). The EWMA
        runs over the bucket's scans: a measurement after `gap` scans of the other path weighs
        what `gap` consecutive ones would, 1 - (1 - alpha)^gap, so a probe's fresh rate all but
        replaces a stale one (one probe notices a shift)."""
        if seconds <= 0:
            return
        key, rate, now = (bucket, speculative), tokens / seconds, self._scans.get(bucket, 0)
        old = self.rate.get(key)
        if old is None:
            self.rate[key] = rate
        else:
            weight = 1 - (1 - self.alpha) ** max(now - self._recorded[key], 1)
            self.rate[key] = old + weight * (rate - old)
        self._recorded[key] = now
