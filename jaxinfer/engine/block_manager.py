"""Host-side KV page allocation: a free list plus per-page refcounts (pure Python, no JAX).

Pages `1 .. num_pages-1` are allocatable; page `SCRATCH_PAGE` (0) never is. A sequence's pages are
`seq.page_ids`, in token order: token `i` lives in page `page_ids[i // page_size]`, slot
`i % page_size`. Two allocation policies:

- `on_demand` (paged): a sequence holds `ceil(n / page_size)` pages for the `n` tokens it needs.
- `reserve_max` (the contiguous max-length baseline): its first allocation reserves pages for
  `seq.max_total_tokens` at once, so later allocations never need anything new.

Refcounts exist for prefix sharing: `share` lets a sequence hold pages another one already holds;
`free` decrements, and a page goes back to the free list only when its count reaches 0.
"""

from __future__ import annotations

from typing import Literal

from jaxinfer.engine.request import Sequence

SCRATCH_PAGE = 0  # == jaxinfer.kv.cache.SCRATCH_PAGE (not imported: this module stays JAX-free)
ALLOCATION_POLICIES = ("on_demand", "reserve_max")
AllocationPolicy = Literal["on_demand", "reserve_max"]


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, policy: AllocationPolicy = "on_demand"):
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(
                f"num_pages={num_pages!r} is invalid: must be an int >= 2 (0 is scratch)"
            )
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} is invalid: must be an int >= 1")
        if policy not in ALLOCATION_POLICIES:
            raise ValueError(
                f"policy={policy!r} is invalid: must be one of {', '.join(ALLOCATION_POLICIES)}"
            )
        self.num_pages, self.page_size, self.policy = num_pages, page_size, policy
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() -> page 1
        self._refcount = [0] * num_pages
        self._holders: dict[Sequence, None] = {}  # sequences holding pages (insertion-ordered set)

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.capacity - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `allocate(seq, num_tokens)` would take (0 if it already has enough)."""
        if self.policy == "reserve_max":
            num_tokens = max(num_tokens, seq.max_total_tokens)
        return max(0, self.pages_for(num_tokens) - len(seq.page_ids))

    # -- allocation --------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Append pages so `seq.page_ids` covers `num_tokens` tokens; all-or-nothing.

        Never shrinks a sequence's pages. Returns False (changing nothing) if too few are free.
        """
        need = self.pages_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            page = self._free.pop()
            self._refcount[page] = 1
            seq.page_ids.append(page)
        if seq.page_ids:
            self._holders[seq] = None
        return True

    def share(self, seq: Sequence, page_ids: list[int]) -> None:
        """Append pages already held by other sequences to `seq.page_ids` (refcount + 1 each)."""
        for page in page_ids:
            if not SCRATCH_PAGE < page < self.num_pages or self._refcount[page] == 0:
                raise ValueError(f"page {page} is not an allocated page and cannot be shared")
            if page in seq.page_ids:
                raise ValueError(f"sequence {seq.seq_id} already holds page {page}")
        for page in page_ids:
            self._refcount[page] += 1
            seq.page_ids.append(page)
        if seq.page_ids:
            self._holders[seq] = None

    def free(self, seq: Sequence) -> None:
        """Release the sequence's pages (a page returns to the free list at refcount 0)."""
        for page in reversed(seq.page_ids):  # reversed: its first page is reused first
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
        seq.page_ids = []
        self._holders.pop(seq, None)

    # -- metrics and checks ------------------------------------------------------------------------
    def wasted_slots(self, seqs: list[Sequence] | None = None) -> int:
        """Allocated token slots minus tokens whose K/V is stored (`num_computed_tokens`).

        Over `seqs`, or every sequence holding pages when None. Shared pages count once per holder.
        """
        seqs = list(self._holders) if seqs is None else seqs
        return sum(len(s.page_ids) * self.page_size - s.num_computed_tokens for s in seqs)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free list and refcounts agree with the holders' pages."""

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise AssertionError(msg)

        free = set(self._free)
        check(len(free) == len(self._free), "a page is on the free list twice")
        check(SCRATCH_PAGE not in free, "the scratch page is on the free list")
        check(self._refcount[SCRATCH_PAGE] == 0, "the scratch page has a refcount")
        holders = [0] * self.num_pages
        for seq in self._holders:
            check(bool(seq.page_ids), f"sequence {seq.seq_id} is registered without pages")
            check(
                len(set(seq.page_ids)) == len(seq.page_ids),
                f"sequence {seq.seq_id} lists a page twice",
            )
            for page in seq.page_ids:
                check(SCRATCH_PAGE < page < self.num_pages, f"sequence holds bad page {page}")
                holders[page] += 1
        for page in range(1, self.num_pages):
            rc = self._refcount[page]
            check(rc == holders[page], f"page {page}: refcount {rc} != {holders[page]} holders")
            check((rc == 0) == (page in free), f"page {page}: refcount {rc}, free={page in free}")
