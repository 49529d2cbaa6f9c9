"""Host-side KV page allocation: a free list plus per-page refcounts (pure Python, no JAX).

Pages `1 .. num_pages-1` are allocatable; page `SCRATCH_PAGE` (0) never is. A sequence's pages are
`seq.page_ids`, in token order: token `i` lives in page `page_ids[i // page_size]`, slot
`i % page_size`. Two allocation policies:

- `on_demand` (paged): a sequence holds `ceil(n / page_size)` pages for the `n` tokens it needs.
- `reserve_max` (the contiguous max-length baseline): its first allocation reserves pages for
  `seq.max_total_tokens` at once, so later allocations never need anything new.

Refcounts exist for prefix sharing: `share` lets a sequence hold pages another one already holds;
`free` decrements, and a page goes back to the free list only when its count reaches 0.

Prefix caching (`prefix_caching=True`, vLLM's design): a full page whose tokens are all known is
registered under a content hash, chained over the pages before it, `sha256(parent digest, salt,
the page's token ids)` (a cryptographic hash: a collision would serve another prompt's K/V;
`salt` carries what else decides a page's contents: the model, its dtypes, the KV dtype). A
sequence admitted with nothing computed takes the longest run of its leading full pages that
are cached (`match_prefix`): shared, refcounted, their prefill skipped. Only full pages are
shared, and never the page of a sequence's last token, so no sequence writes into a page
another reads: the rest of its prompt is computed into its own pages. A hit is checked, not
trusted: the cached page's own tokens and the page before it must be the sequence's, so even a
hash collision (forced in the tests) serves no other prompt's K/V. A cached page that no
sequence holds stays in an LRU pool with its contents, reclaimed for allocation only when the
free list is empty (an eviction drops its hash). A content-addressed table was chosen over a
radix tree: a lookup is one hash per page in a dict, the same structure serves sharing across
unrelated requests, preemption (a re-admitted sequence re-hits its own pages) and n > 1, and it
is a few dozen lines.

Parallel sampling (`SamplingParams.n`): `fork` gives each further sample the full pages of its
parent's prompt before the page of the last prompt token, shared; the rest of the prompt (at
most one page, the last token included) each sample computes into its own page. That recompute
is the copy-on-write of the page where the samples diverge: no device copy op, no new step
shape, and no page is ever written by two sequences.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Literal

import numpy as np

from jaxinfer.engine.request import Sequence

SCRATCH_PAGE = 0  # == jaxinfer.kv.cache.SCRATCH_PAGE (not imported: this module stays JAX-free)
ALLOCATION_POLICIES = ("on_demand", "reserve_max")
AllocationPolicy = Literal["on_demand", "reserve_max"]


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, policy: AllocationPolicy = "on_demand",
                 prefix_caching: bool = False, salt: bytes = b"") -> None:  # fmt: skip
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
        self.prefix_caching, self.salt = prefix_caching, salt
        self._cached: dict[bytes, int] = {}  # content hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> its content hash
        # page -> (the page before it, that page's registration number, its own tokens), and
        # the registration number of each page's current contents
        self._content: dict[int, tuple[int, int, bytes]] = {}
        self._registration: dict[int, int] = {}
        self._registrations = 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody; LRU first
        self.num_evictions = 0
        # a test hook: a hash function to replace sha256 (e.g. one that collides)
        self.digest = lambda data: hashlib.sha256(data).digest()

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages sequences hold (cached pages nobody holds are not counted)."""
        return self.capacity - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (held or not)."""
        return len(self._hash_of)

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
        return self.pages_needed(seq, num_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Append pages so `seq.page_ids` covers `num_tokens` tokens; all-or-nothing.

        Never shrinks a sequence's pages. Returns False (changing nothing) if too few are free.
        Free pages go first; then cached pages nobody holds, least recently used first.
        """
        need = self.pages_needed(seq, num_tokens)
        if need > self.num_free_pages:
            return False
        for _ in range(need):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(page)], self._content[page]
                self.num_evictions += 1
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
        """Release the sequence's pages (a page returns to the free list at refcount 0; a cached
        one to the LRU pool, keeping its contents)."""
        for page in reversed(seq.page_ids):  # reversed: its first page is reused first
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._hash_of:  # most recent, its last pages evicted before its first
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        seq.page_ids = []
        seq.num_registered_pages = 0
        self._holders.pop(seq, None)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Admission of a further sample of `parent`'s prompt: `child` (holding nothing) shares
        the parent's computed full pages before the page of its last prompt token; returns the
        tokens they hold (their prefill skipped)."""
        if child.page_ids or child.num_computed_tokens:
            return 0
        k = min((parent.num_prompt_tokens - 1) // self.page_size, len(parent.page_ids),
                parent.num_computed_tokens // self.page_size)  # fmt: skip
        self.share(child, parent.page_ids[:k])
        child.num_registered_pages = k  # (the parent registered them, with prefix caching)
        return k * self.page_size

    # -- prefix cache ------------------------------------------------------------------------------
    def _page_tokens(self, seq: Sequence, i: int) -> bytes:
        """Page i's token ids as bytes (sliced from the prompt and outputs, not concatenated)."""
        lo, hi, prompt = i * self.page_size, (i + 1) * self.page_size, seq.prompt_token_ids
        n = len(prompt)
        tokens = (
            prompt[lo:hi]
            if hi <= n
            else prompt[lo:] + seq.output_token_ids[max(lo - n, 0) : hi - n]
        )
        return np.asarray(tokens, np.int64).tobytes()

    def _chain(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """Content hashes of `seq`'s first `num_pages` full pages (extending seq.page_hashes)."""
        hashes = seq.page_hashes
        while len(hashes) < num_pages:
            parent = hashes[-1] if hashes else b""
            hashes.append(self.digest(parent + self.salt + self._page_tokens(seq, len(hashes))))
        return hashes[:num_pages]

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens `match_prefix` would find cached for `seq` now (nothing changes)."""
        if not self.prefix_caching or seq.page_ids or seq.num_computed_tokens:
            return 0
        return len(self._matching_pages(seq)) * self.page_size

    def _matching_pages(self, seq: Sequence) -> list[int]:
        known = seq.num_tokens - seq.num_placeholders
        pages: list[int] = []
        for i, h in enumerate(self._chain(seq, (known - 1) // self.page_size)):
            page = self._cached.get(h)
            parent = pages[-1] if pages else SCRATCH_PAGE
            want = (parent, self._registration.get(parent, 0), self._page_tokens(seq, i))
            if page is None or self._content[page] != want:
                break
            pages.append(page)
        return pages

    def match_prefix(self, seq: Sequence) -> int:
        """Admission: share the cached pages of `seq`'s longest cached run of leading full
        pages (it holds none yet, nothing is computed); returns the tokens they hold, which
        need no prefill. The page of its last known token is never matched (it is computed)."""
        if not self.prefix_caching or seq.page_ids or seq.num_computed_tokens:
            return 0
        pages = self._matching_pages(seq)
        for page in pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
            seq.page_ids.append(page)
        if pages:
            self._holders[seq] = None
        seq.num_registered_pages = len(pages)
        return len(pages) * self.page_size

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """`seq`'s first `num_tokens` tokens have their K/V written (or written by a step
        already dispatched, which the device runs before any later reader): register its full
        pages among them, all but the page of its last token (a decode scan may rewrite that
        slot), whose tokens are all known (no placeholder)."""
        if not self.prefix_caching:
            return
        known = seq.num_tokens - seq.num_placeholders
        full = min(min(num_tokens - 1, known) // self.page_size, len(seq.page_ids))
        if full <= seq.num_registered_pages:
            return
        hashes = self._chain(seq, full)
        for i in range(seq.num_registered_pages, full):
            page, h = seq.page_ids[i], hashes[i]
            if page not in self._hash_of and h not in self._cached:  # (a twin may be cached)
                self._cached[h] = page
                self._hash_of[page] = h
                parent = seq.page_ids[i - 1] if i else SCRATCH_PAGE
                self._registrations += 1
                self._registration[page] = self._registrations
                self._content[page] = (parent, self._registration.get(parent, 0),
                                       self._page_tokens(seq, i))  # fmt: skip
        seq.num_registered_pages = full

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
        evictable = set(self._evictable)
        check(not free & evictable, "a page is both free and cached")
        for page in range(1, self.num_pages):
            rc = self._refcount[page]
            check(rc >= 0, f"page {page}: refcount {rc} < 0")
            check(rc == holders[page], f"page {page}: refcount {rc} != {holders[page]} holders")
            idle = page in free or page in evictable
            check((rc == 0) == idle, f"page {page}: refcount {rc}, free or evictable={idle}")
            check(page not in evictable or page in self._hash_of,
                  f"page {page} is evictable but not cached")  # fmt: skip
        for h, page in self._cached.items():
            check(self._hash_of.get(page) == h, f"page {page}: hash tables disagree")
            check(page not in free, f"cached page {page} is on the free list")
