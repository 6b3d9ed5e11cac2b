"""Requests, admission, chunked prefill mixed with decodes, preemption by recompute.

Policies (vLLM's --scheduling-policy): "fcfs" serves requests in arrival order; "priority" in
order of (priority, arrival), a lower value first, as vLLM's; "priority-high-first" a higher value
first, as SGLang's --enable-priority-scheduling by default. The order decides which waiting
request is admitted next, which running ones get the step's token budget first, and which is
preempted when pages run out (the last in that order). A waiting request preempts running ones
only with a preemption threshold (SGLang's --priority-scheduling-preemption-threshold, on under
its --enable-priority-scheduling): when it cannot be admitted (no slot, or too few pages), the
running requests it beats by more than the threshold are preempted, the last in order first, if
that makes room; otherwise nobody is (vLLM's rule: no threshold, no such preemption)."""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4.config import check_policy
from dsv4.prefix_cache import Block, PrefixCache
from dsv4.sampling import SamplingParams
from dsv4.state import DecodeState

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and where its state lives."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose state is in the pools
    num_cached: int = 0  # of them, found in the prefix cache at the latest admission
    cache_tail: Any = None  # (deepest Block the prefix cache holds for it, its block count)
    # (the deepest cached block its tokens reach past its hit, that block's count): another
    # request ran them without a snapshot there; the chunk of this one that reaches it writes it
    shared_at: Any = None
    draft: list[int] = field(default_factory=list)  # speculative tokens after the last (MTP)
    finish_reason: str | None = None
    priority: int = 0  # the priority policies' order (lower first, or higher first)
    arrival: int = field(default_factory=lambda: next(_ids))
    extra: dict[str, Any] = field(default_factory=dict)  # sampler/detokenizer state (engine)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cacheable(self) -> bool:  # prompt logprobs need every prompt token run
        return self.params.prompt_logprobs is None


@dataclass
class Work:
    """A slice of one request to run this step: tokens [start, start + n), then the draft tokens
    to verify (speculative decoding), of which the engine accepts the first `accepted`."""

    request: Request
    start: int
    n: int
    draft: list[int] = field(default_factory=list)
    accepted: int = 0
    # prefix caching: (position, snapshot index, the block it is for: None = the request's own,
    # cached after the step) of each snapshot of the rings the model writes inside this chunk
    # (`Scheduler.snapshots_inside`, `file_snapshots`)
    snapshots: list[tuple[int, int, Any]] = field(default_factory=list)

    @property
    def length(self) -> int:  # tokens this step runs for it: the known ones and the drafts
        return self.n + len(self.draft)

    @property
    def samples(self) -> bool:  # the chunk reaches the last known token: its logits give the next
        return self.start + self.n == self.request.num_tokens


class Scheduler:
    """Decodes and unfinished prefills first, then new requests, within a token budget; in
    arrival order ("fcfs") or (priority, arrival) order ("priority"; "priority-high-first":
    the priority negated)."""

    def __init__(
        self,
        state: DecodeState,
        max_running: int,
        max_step_tokens: int,
        chunk_size: int,
        prefix_cache: PrefixCache | None = None,
        policy: str = "fcfs",
        preemption_threshold: int | None = None,
    ) -> None:
        check_policy(policy, preemption_threshold)
        self.policy, self.preemption_threshold = policy, preemption_threshold
        # the priority's sign in the order: none (fcfs), lower first, higher first
        self._sign = {"fcfs": 0, "priority": 1, "priority-high-first": -1}[policy]
        self.state, self.cache = state, prefix_cache
        self.max_running = min(max_running, state.max_seqs)
        self.max_step_tokens, self.chunk_size = max_step_tokens, chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(state.max_seqs))[::-1]
        self.free_pages = list(range(state.num_blocks))[::-1]
        self.num_preemptions = 0

    # ---- bookkeeping -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        need = self._pages_for(req.num_tokens + req.max_tokens - len(req.output_ids))
        if need > min(self.state.num_blocks, self.state.max_blocks_per_seq):
            raise ValueError(
                f"request {req.request_id} needs {need} pages; the pool has "
                f"{self.state.num_blocks} ({self.state.max_blocks_per_seq} per sequence)"
            )
        self.check_priority(req.priority)
        self._wait(req, front=False)

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 needs a priority policy (vLLM's rule)."""
        if priority and self.policy == "fcfs":
            raise ValueError(
                f"priority {priority} given, but priority scheduling is not enabled "
                "(--scheduling-policy priority, or SGLang's --enable-priority-scheduling)"
            )

    def order(self, req: Request) -> tuple[int, int]:
        """The policy's order: the first is served first, the last is preempted first."""
        return (self._sign * req.priority, req.arrival)

    def _wait(self, req: Request, front: bool) -> None:
        # fcfs: new requests at the back, preempted ones at the front; priority: by order
        if self.policy != "fcfs":
            self.waiting.insert(bisect.bisect(self.waiting, self.order(req), key=self.order), req)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.state.block_size)

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.state.block_table[req.slot].fill_(-1)
            self.free_slots.append(req.slot)
        # a cached block's page stays with the cache; the request's own pages are freed
        self.free_pages += [p for p in req.pages if not (self.cache and self.cache.release(p))]
        req.slot, req.pages, req.num_computed, req.draft = None, [], 0, []
        req.cache_tail = None

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.running) + list(self.waiting):
            if req.request_id == request_id:
                if req in self.waiting:
                    self.waiting.remove(req)
                self.finish(req)
                req.finish_reason = req.finish_reason or "abort"
                return req
        return None

    def _preempt(self, req: Request) -> None:
        """Free everything `req` holds; it recomputes prompt + output when readmitted."""
        self.running.remove(req)
        self._release(req)
        self._wait(req, front=True)
        self.num_preemptions += 1

    def retract_all(self) -> int:
        """Preempt every running request (SGLang's pause mode "retract"): their state is freed
        and they wait, in the policy's order ahead of the others (fcfs; priority: among them by
        order), to recompute prompt + output. Returns how many."""
        running = sorted(self.running, key=self.order, reverse=True)
        for req in running:  # (newest first: each goes to the front, the oldest ends first)
            self._preempt(req)
        return len(running)

    def _grow(self, req: Request, n_tokens: int) -> bool:
        need = self._pages_for(n_tokens) - len(req.pages)
        while (
            need > len(self.free_pages) and self.cache and (page := self.cache.evict()) is not None
        ):
            self.free_pages.append(page)  # cached blocks no one holds go before any preemption
        if need > len(self.free_pages):
            return False
        for _ in range(need):
            page = self.free_pages.pop()
            self.state.block_table[req.slot, len(req.pages)] = page
            req.pages.append(page)
        return True

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        budget, work = self.max_step_tokens, []
        for req in sorted(self.running, key=self.order):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, self.chunk_size, budget)
            # a decode verifies its draft tokens in the same pass, as far as the budget reaches
            draft = req.draft[: budget - 1] if n == req.num_tokens - req.num_computed == 1 else []
            if draft and not self._grow(req, req.num_computed + n + len(draft)):
                draft = []  # no free page for a guess: nobody is preempted for it
            while not self._grow(req, req.num_computed + n):
                victim = max(self.running, key=self.order)  # newest (lowest priority) first
                self._preempt(victim)
                work = [w for w in work if w.request is not victim]
                if victim is req:
                    break
            if req in self.running:
                work.append(Work(req, req.num_computed, n, draft))
                budget -= n + len(draft)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            room = bool(self.free_slots) and len(self.running) < self.max_running
            if not room and (
                self.preemption_threshold is None
                or not self._beats(req, max(self.running, key=self.order))
            ):
                break  # (no slot, and not even the last running request is outranked)
            chain = self._match(req)  # a cached prefix: its pages and the rings after it
            start = len(chain) * self.state.block_size
            n = min(req.num_tokens - start, self.chunk_size, budget)
            need = self._pages_for(start + n) - len(chain)
            spare = len(self.free_pages) + (self.cache.num_evictable if self.cache else 0)
            if not room or need > spare:
                victims = self._outranked(req, need - spare, room)
                if not victims:
                    for b in chain:  # (not held after all)
                        self.cache.release(b.page)
                    break
                for victim in victims:
                    self._preempt(victim)
                    budget += sum(w.length for w in work if w.request is victim)
                    work = [w for w in work if w.request is not victim]
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            if self.cache and req.cacheable:
                self._start_from(req, chain)
            self._grow(req, start + n)
            self.running.append(req)
            work.append(Work(req, start, n))
            budget -= n
        return work

    def _beats(self, req: Request, running: Request) -> bool:
        """Whether waiting `req` may preempt `running`: a threshold is set and `req`'s priority
        beats its by more than that (in the policy's direction)."""
        threshold = self.preemption_threshold
        return threshold is not None and self._sign * (running.priority - req.priority) > threshold

    def _outranked(self, req: Request, pages: int, room: bool) -> list[Request]:
        """With a preemption threshold: the running requests `req` beats by more than it, the
        last in order first, as few as free a slot (unless there is `room`) and `pages` more
        pages (their own, and cached ones no one else holds); [] if they cannot."""
        victims, held = [], Counter()
        for v in sorted(self.running, key=self.order, reverse=True):
            if not self._beats(req, v):
                break  # (the rest come earlier in order: not beaten by more either)
            victims.append(v)
            for p in v.pages:
                b = self.cache.by_page.get(p) if self.cache else None
                held[b] += 1
                pages -= b is None or b.refs == held[b]
            if pages <= 0:
                return victims
        return []

    # ---- prefix caching ------------------------------------------------------------------------
    def _match(self, req: Request) -> list[Block]:
        # the cached prefix `req` starts from, held from here on ([] without caching)
        if self.cache is None or not req.cacheable:
            return []
        shared = self.cache.shared(req.all_ids)  # (one walk of the trie for both)
        chain = self.cache.hit(shared)
        self.cache.acquire(chain)
        req.shared_at = (shared[-1], len(shared)) if len(shared) > len(chain) else None
        return chain

    def _start_from(self, req: Request, chain: list[Block]) -> None:
        # the new slot takes the prefix's pages and the rings after its last block
        req.num_cached = len(chain) * self.state.block_size
        self.cache.count(req.num_tokens, req.num_cached)
        if not chain:
            return
        req.pages = [b.page for b in chain]
        req.cache_tail = (chain[-1], len(chain))
        pages = torch.tensor(req.pages, dtype=torch.long)
        self.state.block_table[req.slot, : len(chain)] = pages.to(self.state.block_table.device)
        self.state.load_snapshot(chain[-1].snapshot, req.slot)
        req.num_computed = req.num_cached

    def snapshots_inside(self, work: list[Work]) -> None:
        """Before a step: snapshot indices for block boundaries inside this step's prefill chunks
        (`Work.snapshots`), where the model writes the rings as they are at the boundary
        (`Batch.snapshots`):
          - a prompt's last boundary before its last token, so a prompt that goes on differently
            (or a follow-up turn) starts there. The chunk is not cut at the boundary: one step,
            not two (a 300-token prompt cut into 256 + 44 took 1.5-2.5x as long on an H200,
            docs/PERF.md);
          - the end of the blocks another request ran and left without a snapshot there, which
            this request's tokens share past its hit (a system prompt shorter than a chunk: the
            third request with it hits).
        The indices are reserved here and filed after the model ran (`file_snapshots`; a failed
        step gives them back, `release_snapshots`), so no block is cached before its pages are
        written. Chunk ends and decode steps on a boundary are snapshotted after the step
        (`cache_prefixes`). At most num_snapshots a step; one sequence's lie at least a ring
        apart (their rows in a step never overlap)."""
        if self.cache is None:
            return
        bs, taken, seen = self.state.block_size, 0, set()
        apart = max(size for _, size in self.state.all_rings)
        for w in work:
            r, places = w.request, []
            if not r.cacheable or w.draft:
                continue
            if r.shared_at is not None and r.shared_at[1] * bs <= w.start + w.n:
                # (the chunk that reaches it, its end included: the chain is another request's,
                # so `cache_prefixes` would not snapshot it)
                block, n = r.shared_at
                r.shared_at = None
                if self.cache.blocks.get(block.key) is block and block.snapshot is None:
                    places.append((n * bs, block))
            at = (r.num_tokens - 1) // bs * bs
            if w.start < at < w.start + w.n:
                # (not where the cache has one, or another prompt of this step takes one: the
                # same tokens, n > 1 completions)
                prefix = tuple(r.all_ids[:at])
                if prefix not in seen and len(self.cache.match(r.all_ids[: at + 1])) < at // bs:
                    places.append((at, None))
                    seen.add(prefix)
            for at, block in places:
                if taken == self.state.num_snapshots or any(
                    abs(at - a) < apart for a, _, _ in w.snapshots
                ):
                    continue
                i = self.cache.reserve_snapshot()
                self.state.snapshot_prior(r.slot, i, at, w.start)
                w.snapshots.append((at, i, block))
                taken += 1

    def file_snapshots(self, work: list[Work]) -> None:
        """After the model ran the step (before finished requests let go of their pages): cache
        each snapshot's blocks and attach it, or give the index back (the blocks are another
        request's pages, or someone snapshotted them meanwhile). `Work.snapshots` keeps the
        attached ones."""
        bs = self.state.block_size
        for w in work:
            r, attached = w.request, []
            for at, i, block in w.snapshots:
                if block is None:  # the request's own chain, cached up to `at` now
                    block, fresh = self.cache.insert(r.all_ids, r.pages, at // bs, r.cache_tail)
                    if block is not None:
                        r.cache_tail = (block, at // bs)
                    ok = fresh
                else:
                    ok = self.cache.blocks.get(block.key) is block and block.snapshot is None
                if ok:
                    self.cache.attach_snapshot(block, i)
                    attached.append((at, i, block))
                else:
                    self.cache.free_snapshot(i)
            w.snapshots = attached

    def release_snapshots(self, work: list[Work]) -> None:
        """Snapshots a step did not complete (it failed; or the request finished in it, so the
        MTP layer's pass did not write their ring): reserved indices go back, filed ones are
        detached from their blocks (which stay cached, pages written)."""
        for w in work:
            for _, i, _ in w.snapshots:
                if not self.cache.forget_snapshot(i):  # (reserved, not filed yet)
                    self.cache.free_snapshot(i)
            w.snapshots = []

    def cache_prefixes(self, work: list[Work]) -> None:
        """After a step (its MTP pass included): where a request's kept state now ends on a block
        boundary (a prefill chunk's end, or a decode step's tokens, generated ones included),
        cache its blocks and snapshot the rings there. Rejected drafts past the boundary wrote
        only ring rows the next token does not read, and pages past it."""
        if self.cache is None:
            return
        bs = self.state.block_size
        for w in work:
            r, end = w.request, w.request.num_computed
            if r.slot is None or not r.cacheable or end % bs or end <= w.start:
                continue
            last, fresh = self.cache.insert(r.all_ids, r.pages, end // bs, r.cache_tail)
            if last is not None:
                r.cache_tail = (last, end // bs)
            if fresh:
                self.state.save_snapshot(r.slot, self.cache.snapshot_slot(last))

    def flush_cache(self) -> int:
        """Drop every cached block no request holds (SGLang's /flush_cache): how many."""
        pages = self.cache.flush() if self.cache else []
        self.free_pages += pages
        return len(pages)

    def advance(self, work: list[Work]) -> None:
        """The step's state is kept for the known tokens and the accepted drafts: a rejected
        draft's writes (window rows, compressor rows, an entry it closed) are addressed by its
        position and rewritten when the next step runs that position again."""
        for w in work:
            w.request.num_computed = w.start + w.n + w.accepted
