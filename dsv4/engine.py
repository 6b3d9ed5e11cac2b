"""Engine.step(): schedule -> batch -> model -> sample -> postprocess. Plus a threaded async front."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from dsv4 import parallel
from dsv4.cuda_graphs import DecodeGraphs
from dsv4.detokenize import IncrementalDetokenizer
from dsv4.model import Transformer
from dsv4.sampling import Sampler, SamplingParams, StopChecker, make_generator
from dsv4.scheduler import Request, Scheduler, Work
from dsv4.state import Batch, DecodeState

log = logging.getLogger("dsv4")


@dataclass
class RequestOutput:
    """What a request produced so far (`delta_*`: this step only)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: request counts and state use."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_free_pages: int
    num_preemptions: int

    @property
    def state_usage(self) -> float:  # fraction of state pages held by requests, 0..1
        return 1.0 - self.num_free_pages / self.num_pages if self.num_pages else 0.0


class EngineError(RuntimeError):
    """Engine.step() failed; the requests it was running were aborted."""


def check_prompt(ids: list[int], vocab_size: int, max_seq_len: int, generate: bool) -> None:
    """Refuse empty, out-of-vocabulary or too-long prompts (`generate`: room for one more token)."""
    if not ids:
        raise ValueError("empty prompt: it must be non-empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) + int(generate) > max_seq_len:
        room = " with room to generate" if generate else ""
        raise ValueError(f"prompt of {len(ids)} tokens exceeds max_seq_len={max_seq_len}{room}")


class Engine:
    """Continuous batching over one model and its decode state."""

    def __init__(
        self,
        model: Transformer,
        state: DecodeState,
        tokenizer,
        *,
        max_running: int,  # noqa: ANN001
        max_step_tokens: int,
        chunk_size: int,
        cuda_graphs: bool = False,
    ) -> None:
        self.model, self.state, self.tokenizer = model, state, tokenizer
        self.graphs = DecodeGraphs(model, state, max_running) if cuda_graphs else None
        self.args = model.args
        self.scheduler = Scheduler(state, max_running, max_step_tokens, chunk_size)
        self.sampler = Sampler(self.args.eos_token_id)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # tensor parallel: rank 0 leads. It hands its adds and aborts, in order, to the other
        # ranks at each step (`tell`), and they repeat them and step with it (`LLM._follow`):
        # the same state gives the same schedule
        self.par = model.par
        self.leads = self.par.world_size > 1 and self.par.rank == 0
        self._outbox: list[tuple] = []
        self.closed = False

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        check_prompt(prompt_ids, self.args.vocab_size, self.state.max_seq_len, generate=True)
        room = self.state.max_seq_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        req = Request(request_id, list(prompt_ids), params, max_tokens)
        req.extra["stop"] = StopChecker(params, self.args.eos_token_id)
        req.extra["gen"] = (
            make_generator(params.seed, self.state.block_table.device)
            if params.seed is not None
            else None
        )
        req.extra["detok"] = (
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        req.extra["out"] = RequestOutput(
            request_id, list(prompt_ids), logprobs=[] if params.logprobs is not None else None
        )
        self.scheduler.add(req)
        self.requests[request_id] = req
        if self.leads:
            self._outbox.append(("add", request_id, list(prompt_ids), params))
        return request_id

    def abort(self, request_id: str) -> None:
        if self.leads:
            self._outbox.append(("abort", request_id))
        req = self.scheduler.abort(request_id)
        if req is not None:
            req.extra["out"].finish_reason = req.finish_reason
            self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        # read without the step lock: each count is one len() (atomic), the set may be mid-step
        s = self.scheduler
        return EngineStats(
            len(s.running), len(s.waiting), s.state.num_blocks, len(s.free_pages), s.num_preemptions
        )

    def tell(self, what: str, *args: object) -> None:
        """Rank 0: send the other ranks the adds and aborts since the last call, then `what`
        ("step", "score" with its arguments, or "stop")."""
        if self.closed:
            raise EngineError("the tensor-parallel engine is closed")
        self.closed = what == "stop"  # (a failed "stop" leaves it closed too)
        parallel.send((self._outbox, what, args))
        self._outbox = []

    def close(self) -> None:
        """Before this rank leaves the process group: rank 0 of several lets the other ranks stop
        (idempotent), and every rank drops its decode graphs. NCCL's communicator teardown
        waits until no graph holds the collectives captured in it, so a rank that left them
        alive would hang in `destroy_process_group`."""
        try:
            if self.leads and not self.closed:
                self.tell("stop")
        finally:
            self.graphs = None

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.leads:
            self.tell("step")
        work = self.scheduler.schedule()
        if not work:
            return []
        logits = self._run(work)
        self.scheduler.advance(work)
        return self._postprocess([w for w in work if w.samples], logits)

    def _run(self, work: list[Work]) -> torch.Tensor:
        if self.graphs is not None and all(w.n == 1 and w.samples for w in work):
            # one new token per sequence: a captured decode step, where one serves
            logits = self.graphs.run(
                [w.request.slot for w in work],
                [w.start for w in work],
                [w.request.all_ids[w.start] for w in work],
            )
            if logits is not None:
                return logits
        dev = self.state.block_table.device
        batch = Batch.build(
            [w.request.slot for w in work], [w.start for w in work], [w.n for w in work], self.state
        )
        flat = torch.tensor(
            [t for w in work for t in w.request.all_ids[w.start : w.start + w.n]],
            dtype=torch.long,
            device=dev,
        )
        h = self.model(flat, batch, self.state)
        last = batch.last_token_idx()[torch.tensor([w.samples for w in work], device=dev)]
        return self.model.logits(h[last])

    def _postprocess(self, work: list[Work], logits: torch.Tensor) -> list[RequestOutput]:
        reqs = [w.request for w in work]
        if not reqs:
            return []
        sample = self.sampler(
            logits,
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [r.extra["gen"] for r in reqs],
        )
        # every rank computed the same logits; rank 0's draw decides, so the ranks never diverge
        self.model.par.broadcast(sample.token_ids)
        outs = []
        for i, req in enumerate(reqs):
            tok = int(sample.token_ids[i])
            out: RequestOutput = req.extra["out"]
            req.output_ids.append(tok)
            detok = req.extra["detok"]
            res = req.extra["stop"].step([tok], detok.step if detok else (lambda ids: ""))
            out.delta_token_ids = [tok]  # a stop token stays in token_ids; its text does not
            out.token_ids = list(req.output_ids)
            out.delta_text = res.delta
            out.text += res.delta
            if out.logprobs is not None:
                n = req.params.logprobs
                entry = {"token_id": tok, "logprob": float(sample.logprobs[i])}
                if n:
                    entry["top"] = list(
                        zip(sample.top_ids[i, :n].tolist(), sample.top_logprobs[i, :n].tolist())
                    )
                out.logprobs.append(entry)
            if res.finish_reason is None and len(req.output_ids) >= req.max_tokens:
                res.finish_reason = "length"
            if res.finish_reason is not None:
                req.finish_reason = out.finish_reason = res.finish_reason
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)
            outs.append(out)
        return outs


class AsyncEngine:
    """Runs Engine.step() on a background thread; `generate` streams RequestOutputs per step.

    Callers never wait for a step: adds and aborts go into an inbox that the engine thread drains
    between steps (a lock shared with the stepping thread would starve an event loop).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: deque[tuple] = deque()  # ("add", rid, ids, params) | ("abort", rid)
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dsv4-engine")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._drain_inbox()  # also after stop: pending aborts free their state
            if self._stop:
                return
            try:
                outs = self.engine.step() if self.engine.has_work() else None
            except Exception as e:  # a failed step must not strand its callers or stop the loop
                log.exception("engine step failed; aborting the running requests")
                self._fail_running(e)
                continue
            if outs is None:
                self._wake.wait(0.05)  # a set() racing with clear() is harmless: we drain next
                self._wake.clear()
                continue
            for out in outs:
                # the engine rebinds token_ids / delta lists every step and never touches the
                # prompt: only logprobs grows in place (no O(prompt) copy per token)
                logprobs = None if out.logprobs is None else list(out.logprobs)
                self._deliver(out.request_id, dataclasses.replace(out, logprobs=logprobs))

    def _deliver(self, rid: str, item: RequestOutput | Exception) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, rid, *args = self._inbox.popleft()
            if kind == "abort":
                self.engine.abort(rid)  # no-op when finished or unknown
                continue
            try:
                self.engine.add_request(*args, rid)
            except Exception as e:  # refused (ValueError): the caller's generate raises it
                self._deliver(rid, e)

    def _fail_running(self, error: Exception) -> None:
        failed = EngineError(f"engine step failed: {error!r}")
        failed.__cause__ = error
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._deliver(rid, failed)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, one per step; raises ValueError if the engine refuses it and
        EngineError if a step fails. Closing the generator aborts the request."""
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"duplicate request id {rid!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        self._inbox.append(("add", rid, list(prompt_ids), params))
        self._wake.set()
        try:
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self.abort(rid)  # no-op when finished; frees state on cancel/disconnect

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
