"""`InFlight`'s contract on the host alone (no model, no device): placeholders at dispatch, reads
in dispatch order filling the oldest placeholder, dropped placeholders, and the asserts that
guard the invariants of `inflight.py`."""

from __future__ import annotations

import pytest

from jaxinfer.engine.inflight import InFlight, UnreadScan
from jaxinfer.engine.request import SamplingParams, Sequence


def seq(seq_id: int) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], SamplingParams(max_tokens=8), output_token_ids=[4])


def test_reads_fill_the_oldest_placeholder_in_dispatch_order():
    a, b = seq(0), seq(1)
    fl = InFlight()
    assert not fl.unread and fl.feed is None and not fl.plain
    fl.dispatch_mixed([(a, 0, 2), (b, 1, 0)], "outs N")  # a verifies 2 drafts
    assert a.output_token_ids == [4, -1] and b.output_token_ids == [4, -2]
    assert (a.num_placeholders, a.pending_extra_tokens) == (1, 2)
    assert fl.unread and fl.feed == "outs N" and not fl.plain and fl.scan is None
    fl.dispatch_mixed([(b, 0, 0), (a, 1, 0)], "outs N+1")  # the plain step that feeds them
    assert a.output_token_ids == [4, -1, -2] and a.num_placeholders == 2
    assert a.pending_extra_tokens == 0 and fl.plain and fl.feed == "outs N+1"

    step = fl.take(keep=1)  # the older one; the newer stays in flight
    assert step.outs == "outs N" and step.verifies and fl.take(keep=1) is None
    assert fl.fill(a, 0, [7, 8, 9]) == 1  # the verification kept 3 tokens
    assert a.output_token_ids == [4, 7, 8, 9, -2] and a.num_placeholders == 1
    assert fl.fill(b, 1, [5]) == 1 and b.output_token_ids == [4, 5, -1]
    with pytest.raises(AssertionError):
        fl.fill(b, 1, [6])  # its oldest placeholder is row 0 of the next step
    step = fl.take()
    assert step.outs == "outs N+1" and not step.verifies and not fl.unread
    assert fl.take() is None
    assert fl.fill(b, 0, [6]) == 2 and b.output_token_ids == [4, 5, 6] and not b.num_placeholders


def test_a_finished_sequence_drops_its_placeholders():
    a = seq(0)
    fl = InFlight()
    fl.dispatch_mixed([(a, 3, 1)], "outs N")
    fl.dispatch_mixed([(a, 0, 0)], "outs N+1")
    fl.drop(a)
    assert a.output_token_ids == [4] and (a.num_placeholders, a.pending_extra_tokens) == (0, 0)
    fl.drop(a)  # (nothing left to drop)
    assert a.output_token_ids == [4]


def test_at_most_one_unread_step_before_a_dispatch_of_its_kind():
    a, b = seq(0), seq(1)
    fl = InFlight()
    fl.dispatch_mixed([(a, 0, 0)], "outs N")
    fl.dispatch_mixed([(b, 0, 0)], "outs N+1")
    with pytest.raises(AssertionError):  # step N was never read
        fl.dispatch_mixed([], "outs N+2")
    fl.take()
    with pytest.raises(AssertionError):  # a scan starts from tokens on the host (6)
        fl.dispatch_scan(UnreadScan([seq(2)], "outs", None, None, 8, 4))
    fl.take()  # (b's placeholder not filled)
    with pytest.raises(AssertionError):  # ... none of them a placeholder
        fl.dispatch_scan(UnreadScan([b], "outs", None, None, 8, 4))
    fl.dispatch_scan(UnreadScan([seq(2)], "outs", None, None, 8, 4))
    assert fl.unread and fl.scan is not None


def test_a_verification_only_for_a_sequence_without_placeholders():
    a = seq(0)
    fl = InFlight()
    fl.dispatch_mixed([(a, 0, 0)], "outs N")
    with pytest.raises(AssertionError):  # a proposer needs the real last token (7)
        fl.dispatch_mixed([(a, 0, 2)], "outs N+1")


def test_a_chained_scan_follows_the_unread_scan():
    a = seq(0)
    fl = InFlight()
    first = UnreadScan([a], "outs 1", None, None, 8, 4)
    fl.dispatch_scan(first)
    assert fl.scan is first and fl.feed is None and not fl.plain
    fl.dispatch_scan(UnreadScan([a], "outs 2", None, None, 8, 4))
    assert fl.take() is first and fl.scan.outs == "outs 2"
    with pytest.raises(AssertionError):  # the unread step is a scan (6)
        fl.dispatch_mixed([(a, 0, 0)], "outs")
