"""Prefix caching: a request starts from the state another request left at a block boundary.

DeepSeek-V4's state (`dsv4.state`) has two parts:
  - pages of compressed entries and indexer keys. A block's tokens fill its page for good: entry w
    closes at token m*w + m - 1, inside the block, and later tokens never write it again;
  - per-slot rings: the window's K=V and the compressors' open windows (with CSA's last closed
    half-window). Later tokens overwrite them.
So a cached prefix of P tokens (a multiple of the block size) is the pages of its blocks, shared
by reference count, plus a snapshot of the rings at P (`DecodeState.save_snapshot`), copied into
the new request's slot (`load_snapshot`). Snapshots are taken wherever a step leaves a sequence
on a block boundary (prefill chunks and decode steps, so generated tokens are cached too), and
inside a chunk: at a prompt's last block boundary before its last token, and where the blocks
it shares with an earlier request end; the model writes the rings as they are there into the
snapshot (`Scheduler.snapshots_inside`).

Blocks are keyed exactly by (parent block id, the block's token ids): a trie, no hash that could
collide. A request hits the longest chain of cached blocks ending at a snapshot that leaves it at
least one token to run (its logits start the generation). Unreferenced blocks stay cached until
their page is needed; then the least recently used leaf goes first, so no cached block is ever
unreachable. A snapshot is a copy: the least recently used one is dropped for a new one.

Requests that ask for prompt logprobs neither hit nor fill the cache (the cached tokens would not
be run), as in vLLM.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One cached block: its page, the snapshot of the rings after it (if any), its holders."""

    key: tuple[int, tuple[int, ...]]  # (parent block id, 0 = none; the block's token ids)
    id: int
    page: int
    parent: Block | None
    snapshot: int | None = None
    refs: int = 0  # running requests whose block table holds the page
    children: int = 0


class PrefixCache:
    """The cached blocks of one DecodeState's pages and snapshots (bookkeeping only: the
    scheduler moves pages, the state copies rings)."""

    def __init__(self, block_size: int, num_snapshots: int) -> None:
        if num_snapshots < 1:
            raise ValueError(f"prefix caching needs >= 1 snapshot, got {num_snapshots}")
        self.block_size = block_size
        self.blocks: dict[tuple[int, tuple[int, ...]], Block] = {}
        self.by_page: dict[int, Block] = {}
        # blocks a page can be taken from (no holder, no child), least recently used first
        self.evictable: OrderedDict[int, Block] = OrderedDict()
        self.free_snapshots = list(range(num_snapshots))[::-1]
        self.with_snapshot: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self.queries = self.hits = 0  # prompt tokens looked up / found (vLLM's counters)
        # cached blocks no request holds: pages eviction can free, one leaf after another (a
        # request holds its whole chain from the first block, so none has a held descendant)
        self.num_evictable = 0

    # ---- lookups -----------------------------------------------------------------------------
    def match(self, ids: list[int]) -> list[Block]:
        """The longest chain of cached blocks over `ids` that ends at a snapshot and leaves at
        least the last token to run ([] if none)."""
        return self.hit(self.shared(ids))

    @staticmethod
    def hit(shared: list[Block]) -> list[Block]:
        """`match` of the chain `shared` gave: cut back to its last snapshot."""
        n = len(shared)
        while n and shared[n - 1].snapshot is None:
            n -= 1
        return shared[:n]

    def shared(self, ids: list[int]) -> list[Block]:
        """The longest chain of cached blocks over `ids` that leaves at least the last token to
        run, snapshots or not: where it goes past `match`, another request ran these tokens and
        snapshotted none of its boundaries past the hit."""
        bs, parent, chain = self.block_size, 0, []
        for j in range((len(ids) - 1) // bs):
            b = self.blocks.get((parent, tuple(ids[j * bs : (j + 1) * bs])))
            if b is None:
                break
            chain.append(b)
            parent = b.id
        return chain

    def acquire(self, chain: list[Block]) -> None:
        """A request now holds these blocks' pages (and will read the last one's snapshot)."""
        for b in chain:
            self.num_evictable -= b.refs == 0
            b.refs += 1
            self.evictable.pop(b.id, None)
        if chain and chain[-1].snapshot is not None:
            self.with_snapshot.move_to_end(chain[-1].id)

    def release(self, page: int) -> bool:
        """A request lets go of `page`: True if the cache keeps it (a cached block), False if the
        page was the request's own (the caller frees it)."""
        b = self.by_page.get(page)
        if b is None:
            return False
        b.refs -= 1
        self.num_evictable += b.refs == 0
        self._maybe_evictable(b)
        return True

    def count(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    # ---- filling -----------------------------------------------------------------------------
    def insert(
        self,
        ids: list[int],
        pages: list[int],
        n_blocks: int,
        tail: tuple[Block, int] | None = None,
    ) -> tuple[Block | None, bool]:
        """Cache the first n_blocks full blocks of a running request (tokens `ids`, its pages in
        order), which holds them; tail: (its deepest block the cache holds, that block's count)
        from an earlier call, where the walk resumes (a long sequence is not walked again at
        each boundary). -> (the last block, whether it is this request's to snapshot: it needs
        one and the chain is the request's own pages; None if a block of these tokens is cached
        in another page (two requests prefilled the same tokens at once: the rest stays
        private))."""
        bs = self.block_size
        parent, first = tail if tail is not None else (None, 0)
        b = parent
        for j in range(first, n_blocks):
            key = (parent.id if parent else 0, tuple(ids[j * bs : (j + 1) * bs]))
            b = self.blocks.get(key)
            if b is None:
                b = Block(key, next(self._ids), pages[j], parent, refs=1)
                self.blocks[key] = b
                self.by_page[b.page] = b
                if parent is not None:
                    parent.children += 1
                    self.evictable.pop(parent.id, None)
            elif b.page != pages[j]:
                return None, False
            parent = b
        return b, b is not None and b.snapshot is None

    def snapshot_slot(self, b: Block) -> int:
        """A snapshot index for block b (the least recently used one's, if none is free)."""
        i = self.reserve_snapshot()
        self.attach_snapshot(b, i)
        return i

    def reserve_snapshot(self) -> int:
        """A snapshot index no block holds (the least recently used one's, if none is free),
        for a step to write: after it, `attach_snapshot` or `free_snapshot`."""
        if not self.free_snapshots:
            _, old = self.with_snapshot.popitem(last=False)
            self.free_snapshots.append(old.snapshot)
            old.snapshot = None
        return self.free_snapshots.pop()

    def attach_snapshot(self, b: Block, i: int) -> None:
        b.snapshot = i
        self.with_snapshot[b.id] = b

    def free_snapshot(self, i: int) -> None:
        self.free_snapshots.append(i)

    def forget_snapshot(self, i: int) -> bool:
        """Snapshot i was not completed (its request finished inside the step that was to write
        it, before the MTP layer's pass): its block keeps its page, without a snapshot. False if
        no block holds i."""
        for b in self.with_snapshot.values():
            if b.snapshot == i:
                del self.with_snapshot[b.id]
                b.snapshot = None
                self.free_snapshots.append(i)
                return True
        return False

    # ---- eviction ----------------------------------------------------------------------------
    def evict(self) -> int | None:
        """Drop the least recently used unheld leaf block: its page (to free), or None."""
        if not self.evictable:
            return None
        _, b = self.evictable.popitem(last=False)
        self.num_evictable -= 1
        del self.blocks[b.key]
        del self.by_page[b.page]
        if b.snapshot is not None:
            del self.with_snapshot[b.id]
            self.free_snapshots.append(b.snapshot)
        if b.parent is not None:
            b.parent.children -= 1
            self._maybe_evictable(b.parent)
        return b.page

    def flush(self) -> list[int]:
        """Drop every block no request holds: their pages (to free)."""
        pages = []
        while (page := self.evict()) is not None:
            pages.append(page)
        return pages

    def _maybe_evictable(self, b: Block) -> None:
        if b.refs == 0 and b.children == 0:
            self.evictable[b.id] = b  # (a block just let go of is the most recently used)
