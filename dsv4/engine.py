"""Engine.step(): schedule -> batch -> model -> sample -> postprocess. Plus a threaded async front."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from dsv4.detokenize import IncrementalDetokenizer
from dsv4.model import Transformer
from dsv4.sampling import Sampler, SamplingParams, StopChecker, make_generator
from dsv4.scheduler import Request, Scheduler, Work
from dsv4.state import Batch, DecodeState


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
    ) -> None:
        self.model, self.state, self.tokenizer = model, state, tokenizer
        self.args = model.args
        self.scheduler = Scheduler(state, max_running, max_step_tokens, chunk_size)
        self.sampler = Sampler(self.args.eos_token_id)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

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
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            req.extra["out"].finish_reason = req.finish_reason
            self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        work = self.scheduler.schedule()
        if not work:
            return []
        logits = self._run(work)
        self.scheduler.advance(work)
        return self._postprocess([w for w in work if w.samples], logits)

    def _run(self, work: list[Work]) -> torch.Tensor:
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
    """Runs Engine.step() on a background thread; `generate` streams RequestOutputs per step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dsv4-engine")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                outs = self.engine.step() if self.engine.has_work() else None
            if outs is None:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for out in outs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    loop, q = target
                    snapshot = RequestOutput(
                        **{
                            k: (list(v) if isinstance(v, list) else v)
                            for k, v in out.__dict__.items()
                        }
                    )
                    loop.call_soon_threadsafe(q.put_nowait, snapshot)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, request_id)
            self._queues[rid] = (asyncio.get_running_loop(), q)
        self._wake.set()
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            with self._lock:
                self.engine.abort(rid)  # no-op when finished; frees state on cancel/disconnect

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
