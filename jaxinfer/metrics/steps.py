"""One row of per-engine-step statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepRecord:
    """What one engine step did.

    time: engine clock (s) at the end of the step; num_seqs: sequences in the batch;
    num_batched_tokens: real tokens fed to the model; kv_pages_used / kv_pages_total: KV cache
    pages in use after the step / in the pool; kv_slots_allocated: token slots in the pages held by
    running sequences; wasted_slots: those of them holding no token (internal fragmentation plus
    reservations: the paged-vs-contiguous measure); decode_steps: tokens per sequence in this
    step's jitted call (>1 on the decode fast path); preemptions: sequences preempted in this step; device_ms: time the host waited for the
    device's results; host_ms: the rest of the step's wall time (scheduling, batch building,
    post-processing); kv_pages_cached: pages in the prefix cache (held or not; those no
    sequence holds are not in kv_pages_used); evictions: cached pages reclaimed in this step.
    With async decode, device work overlaps host work, so device_ms is the part of the device
    time the host could not hide. MoE models only (else None):
    expert_tokens, the (token, choice) rows routed to each expert, summed over the MoE layers,
    in the device results this step read (padding tokens route nowhere); expert_device_tokens,
    the same per device of the mesh's "expert" axis (one entry without expert parallelism);
    experts_active, the experts given at least one row per MoE layer and forward pass, averaged
    (what sets a decode step's expert weight traffic). Speculative decoding: draft_tokens,
    the drafts verified in the results this step read; accepted_draft_tokens, those kept;
    accepted_hist[j], the verifications (one sequence, one target pass) that kept j drafts;
    speculative, whether the results it read came from the speculative path (a decode scan
    that drafted, a mixed step that verified drafts): with engine.speculative.adaptive the
    decode scans without it are those the engine chose to run plain.
    """

    time: float
    num_seqs: int
    num_batched_tokens: int
    kv_pages_used: int
    kv_pages_total: int
    wasted_slots: int = 0
    is_decode_only: bool = False
    preemptions: int = 0
    host_ms: float = 0.0
    device_ms: float = 0.0
    kv_slots_allocated: int = 0
    decode_steps: int = 1
    kv_pages_cached: int = 0
    evictions: int = 0
    expert_tokens: list[int] | None = None
    expert_device_tokens: list[int] | None = None
    experts_active: float | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_hist: list[int] | None = None
    speculative: bool = False

    def to_row(self) -> dict:
        return asdict(self)


STEP_COLUMNS = tuple(f.name for f in fields(StepRecord))


def step_row(step: StepRecord | dict) -> dict:
    """A StepRecord, or a dict of its fields (defaults filled in), as a dict keyed by STEP_COLUMNS."""
    if isinstance(step, StepRecord):
        return step.to_row()
    unknown = sorted(set(step) - set(STEP_COLUMNS))
    if unknown:
        raise ValueError(f"step row has unknown fields {unknown}: allowed are {STEP_COLUMNS}")
    try:
        return StepRecord(**step).to_row()
    except TypeError as e:
        raise ValueError(f"step row is incomplete: {e}") from None
