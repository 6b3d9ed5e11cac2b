"""Engine.step(): schedule -> batch -> model -> sample -> postprocess. Plus a threaded async front."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4 import parallel
from dsv4.automaton import Automaton
from dsv4.cuda_graphs import DecodeGraphs
from dsv4.detokenize import IncrementalDetokenizer
from dsv4.grammar import (
    AfterTrigger,
    JsonGrammar,
    JsonState,
    SchemaGrammar,
    SchemaState,
    forced_after,
    token_bytes,
)
from dsv4.model import Transformer
from dsv4.piecewise import PIECEWISE_MAX_TOKENS, PiecewiseGraphs
from dsv4.prefix_cache import PrefixCache
from dsv4.profiler import ProfilerError, StepProfiler
from dsv4.sampling import SampleOutput, Sampler, SamplingParams, StopChecker, make_generator
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
    # what stopped it (finish_reason "stop"): a stop token id or stop string; None for EOS
    stop_reason: int | str | None = None
    logprobs: list[dict] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), set once
    # the prompt is in
    prompt_logprobs: list[dict | None] | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's name)
    # time.monotonic() when a step first ran it (vLLM's RequestMetrics.first_scheduled_time)
    first_scheduled_time: float | None = None
    # SamplingParams.n > 1 (`LLM.generate`): this is completion `index` of its prompt; the first
    # one holds all n in `choices`
    index: int = 0
    choices: list[RequestOutput] | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's RequestOutput.outputs: the prompt's completions (each with text, token_ids,
        finish_reason, logprobs, index)."""
        return self.choices if self.choices is not None else [self]

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
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    num_accepted_tokens: int = 0
    num_drafts: int = 0  # verifications (a sequence's drafts of one step)
    prefix_cache_queries: int = 0  # prefix caching: prompt tokens looked up, and found
    prefix_cache_hits: int = 0
    # verifications whose draft j (0-based) was accepted, per position (vLLM's per-position rate)
    num_accepted_per_pos: tuple[int, ...] = ()

    @property
    def mean_accept_length(self) -> float | None:
        """Tokens a verification yields on average: the accepted drafts and the sampled token
        (SGLang's "accept length"); None before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

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
        num_speculative_tokens: int = 0,
        enable_prefix_caching: bool = False,
        scheduling_policy: str = "fcfs",
        priority_preemption_threshold: int | None = None,
    ) -> None:
        self.model, self.state, self.tokenizer = model, state, tokenizer
        # speculative decoding: the MTP layer drafts this many tokens after each sampled one,
        # and the next step verifies them in the same pass as that token (`_sample`, `_draft`)
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_speculative_tokens and not len(model.mtp):
            raise ValueError(
                "speculative decoding with MTP needs the model's MTP layer: this checkpoint has "
                "none (num_nextn_predict_layers = 0, or no mtp.* tensors)"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.cuda_graphs = cuda_graphs
        self._graph_sizes = (max_running, max_step_tokens)
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        self.make_graphs()
        # why requests are refused (LLM.sleep: the memory is given back), None when they are not
        self.asleep: str | None = None
        self.num_draft_tokens = self.num_accepted_tokens = self.num_drafts = 0  # for metrics
        self.num_accepted_per_pos = [0] * num_speculative_tokens
        # called with each step's token count (the server's vllm:iteration_tokens_total)
        self.on_step: Callable[[int], None] | None = None
        self.args = model.args
        # prefix caching: cached blocks' pages are shared, the state's snapshots hold the rings
        cache = (
            PrefixCache(state.block_size, state.num_snapshots) if enable_prefix_caching else None
        )
        self.scheduler = Scheduler(
            state, max_running, max_step_tokens, chunk_size, cache, scheduling_policy,
            priority_preemption_threshold,
        )  # fmt: skip
        self.sampler = Sampler(self.args.eos_token_id)
        self._json_grammar: JsonGrammar | None = None
        self._schema_grammars: dict[Automaton, SchemaGrammar] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # tensor parallel: rank 0 leads. It hands its adds and aborts, in order, to the other
        # ranks at each step (`tell`), and they repeat them and step with it (`LLM._follow`):
        # the same state gives the same schedule
        self.par = model.par
        self.leads = self.par.world_size > 1 and self.par.rank == 0
        # /start_profile's torch profiler, ticked by each step on every rank (`profile`)
        self.profiler = StepProfiler(self.par.rank)
        self._outbox: list[tuple] = []
        self.closed = False

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; priority: its place under a priority scheduling policy (lower first,
        or higher first; any other value than 0 is refused under "fcfs", as vLLM does)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.asleep:
            raise ValueError(self.asleep)
        if params.n != 1:
            raise ValueError(f"one request is one completion (n={params.n}): LLM.generate and "
                             "the server run n requests, `SamplingParams.choice`")  # fmt: skip
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        check_prompt(prompt_ids, self.args.vocab_size, self.state.max_seq_len, generate=True)
        bad = [t for t in params.token_ids() if t >= self.args.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias / allowed_token_ids name token ids out of range "
                f"[0, {self.args.vocab_size}): {bad[:5]}"
            )
        room = self.state.max_seq_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        req = Request(request_id, list(prompt_ids), params, max_tokens, priority=priority)
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
        # constrained decoding: a mask per step from the output so far (`Sampler.constrain`)
        automaton = params.automaton()
        eos, vocab = self.args.eos_token_id, self.args.vocab_size
        constraint = (
            JsonState(self.json_grammar()) if params.json_object
            else SchemaState(self.schema_grammar(automaton)) if automaton is not None else None
        )  # fmt: skip
        if params.forced_after:  # thinking mode's forced tool call: its start, then the arguments
            constraint = forced_after(*params.forced_after, eos, vocab, then=constraint)
        if params.constrain_after is not None:  # thinking mode: the answer after `</think>`
            constraint = AfterTrigger(params.constrain_after, constraint, eos, vocab)
        req.extra["constraint"] = constraint
        self.scheduler.add(req)
        self.requests[request_id] = req
        if self.leads:
            self._outbox.append(("add", request_id, list(prompt_ids), params, priority))
        return request_id

    def json_grammar(self) -> JsonGrammar:
        """JSON mode's token tables, built on first use from the tokenizer (~1 s for 129K)."""
        if self._json_grammar is None:
            if self.tokenizer is None:
                raise ValueError("JSON mode and structured outputs need the model's tokenizer.json")
            tokens = token_bytes(self.tokenizer, self.args.vocab_size)
            self._json_grammar = JsonGrammar(tokens, self.args.eos_token_id)
        return self._json_grammar

    def schema_grammar(self, automaton: Automaton) -> SchemaGrammar:
        """Structured outputs' token masks for one compiled schema (kept for the last 64)."""
        grammar = self._schema_grammars.pop(automaton, None) or SchemaGrammar(
            automaton, self.json_grammar()
        )
        self._schema_grammars[automaton] = grammar  # (most recent last)
        while len(self._schema_grammars) > 64:
            del self._schema_grammars[next(iter(self._schema_grammars))]
        return grammar

    def abort(self, request_id: str) -> None:
        if self.leads:
            self._outbox.append(("abort", request_id))
        req = self.scheduler.abort(request_id)
        if req is not None:
            req.extra["out"].finish_reason = req.finish_reason
            self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def retract(self) -> int:
        """Every running request back to the waiting queue, its state freed (every rank: the
        schedulers must stay alike); they recompute when admitted again. How many."""
        if self.leads:
            self._outbox.append(("retract", ""))
        return self.scheduler.retract_all()

    def flush_cache(self) -> int:
        """Drop the cached prefixes no running request holds (every rank: the schedulers must
        stay alike): how many blocks."""
        if self.leads:
            self._outbox.append(("flush", ""))
        return self.scheduler.flush_cache()

    def stats(self) -> EngineStats:
        # read without the step lock: each count is one len() (atomic), the set may be mid-step
        s = self.scheduler
        return EngineStats(
            len(s.running),
            len(s.waiting),
            s.state.num_blocks,
            len(s.free_pages) + (s.cache.num_evictable if s.cache else 0),  # (cached, unheld)
            s.num_preemptions,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.num_drafts,
            s.cache.queries if s.cache else 0,
            s.cache.hits if s.cache else 0,
            tuple(self.num_accepted_per_pos),
        )

    def profile(
        self,
        action: str,
        output_dir: str | None = None,
        num_steps: int | None = None,
        cuda: bool = False,
        start_step: int = 0,
    ) -> Path:
        """Start ("start", with `StepProfiler.start`'s arguments) or stop ("stop") the torch
        profiler between steps; rank 0 of several tells the other ranks once its own call is
        taken (`follow_profile`), so every rank writes a trace under rank 0's id. Returns this
        rank's trace path; ProfilerError when refused."""
        p = self.profiler
        if action == "start":
            path = p.start(output_dir, num_steps, cuda, start_step)
            if self.leads:
                self.tell("profile", "start", output_dir, num_steps, cuda, start_step, p.trace_id)
            return path
        try:
            return p.stop()
        finally:  # (a cancelled or finished run: theirs end alike)
            if self.leads:
                self.tell("profile", "stop")

    def follow_profile(self, action: str, *args: object) -> None:
        """Ranks > 0: rank 0's `profile` on this rank (a stop finds it stopped when num_steps
        ended it, or cancels one not begun: nothing to write)."""
        if action == "start":
            self.profiler.start(*args)
        elif self.profiler.active:
            log.info("rank %d: profile written to %s", self.par.rank, self.profiler.stop())
        elif self.profiler.pending:
            with contextlib.suppress(ProfilerError):
                self.profiler.stop()

    def tell(self, what: str, *args: object) -> None:
        """Rank 0: send the other ranks the adds and aborts since the last call, then `what`
        ("step", "score" with its arguments, "compile_graphs", "reload" with a checkpoint's path,
        "update", "sleep" / "wake_up" with theirs, "profile" with `profile`'s, or "stop")."""
        if self.closed:
            raise EngineError("the tensor-parallel engine is closed")
        self.closed = what == "stop"  # (a failed "stop" leaves it closed too)
        parallel.send(what, (self._outbox, args) if self._outbox or args else None)
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
            self.drop_graphs()

    def drop_graphs(self) -> None:
        """Let the CUDA graphs go (their memory pools with them): at close, and before
        `LLM.sleep` gives back the memory they read."""
        self.graphs = self.pieces = None

    def make_graphs(self) -> None:
        """New, empty CUDA graphs (captured as steps meet them), when the engine has them: at
        start, and after `LLM.wake_up` (the memory the old ones read was given back)."""
        if not self.cuda_graphs:
            return
        max_running, max_step_tokens = self._graph_sizes
        self.graphs = DecodeGraphs(
            self.model, self.state, max_running, 1 + self.num_speculative_tokens
        )
        # the steps with a prefill chunk: piecewise graphs around the eager attention. One rank
        # for now: the pieces run on two ranks on the CPU (tests/test_piecewise.py), but their
        # captured all-reduces have not run on two GPUs yet
        if self.model.par.world_size == 1:
            self.pieces = PiecewiseGraphs(
                self.model, self.state, min(max_step_tokens, PIECEWISE_MAX_TOKENS)
            )

    def compile_graphs(self) -> int:
        """Every rank (rank 0 tells the others): run each decode graph's step once eagerly on a
        free slot (`DecodeGraphs.compile_all`), so the bounds a long generation reaches later do
        not compile kernels inside their capture. Only with no request in the engine. Returns the
        steps run (0 without graphs)."""
        s = self.scheduler
        if self.graphs is None:
            return 0
        if s.running or s.waiting:
            raise EngineError("compile_graphs needs an empty engine")
        if self.leads:
            self.tell("compile_graphs")
        return self.graphs.compile_all(s.free_slots[-1])

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outs = self._schedule_and_run()
        trace = self.profiler.step()  # (every rank steps alike: they count the same steps)
        if trace is not None:
            log.info("rank %d: profile of the asked-for steps written to %s", self.par.rank, trace)
        return outs

    def _schedule_and_run(self) -> list[RequestOutput]:
        if self.asleep and self.scheduler.has_work():  # (the weights or the state are gone)
            raise EngineError(self.asleep)
        if self.leads:
            self.tell("step")
        work = self.scheduler.schedule()
        if not work:
            return []
        self.scheduler.snapshots_inside(work)
        try:
            outs = self._step(work)
        except BaseException:
            self.scheduler.release_snapshots(work)  # (none is left half-written)
            raise
        self.scheduler.cache_prefixes(work)  # (after the MTP pass: its ring is in the snapshot)
        return outs

    def _step(self, work: list[Work]) -> list[RequestOutput]:
        # the step's work run, sampled and post-processed; its snapshots inside chunks filed
        now = time.monotonic()
        for w in work:
            out = w.request.extra["out"]
            if out.first_scheduled_time is None:
                out.first_scheduled_time = now
        if self.on_step is not None:  # the tokens this step runs (vLLM's iteration_tokens_total)
            self.on_step(sum(w.length for w in work))
        # rejected drafts past the first overwrite ring rows that the next step reads: kept
        ahead = [(w, j) for w in work for j in range(2, len(w.draft) + 1)]
        saved = self.state.save_rows(
            range(self.args.n_layers),
            [w.request.slot for w, _ in ahead],
            [w.start + j for w, j in ahead],
        )
        h, logits = self._run(work)
        if any(w.request.params.prompt_logprobs is not None for w in work):
            self._prompt_logprobs(work, h)
        sampled = [w for w in work if w.samples]
        tokens, logprobs = self._sample(sampled, logits)
        self.state.restore_rows(saved, [j > w.accepted + 1 for w, j in ahead])
        self.scheduler.advance(work)
        self.scheduler.file_snapshots(work)  # (before finished requests let go of their pages)
        outs = self._postprocess(sampled, tokens, logprobs)
        if self.num_speculative_tokens:
            self._draft(work, h)  # (it writes the snapshots' MTP rings)
            for w in work:  # finished in this step: no MTP pass wrote its snapshots' ring
                if w.request.slot is None:
                    self.scheduler.release_snapshots([w])
        return outs

    def _run(self, work: list[Work]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model over the step's tokens -> (streams [T, n, D] before hc_head, None from a
        graph of plain decode steps; fp32 logits of each sampling work's last known token and
        its drafts, in order)."""
        k = self.num_speculative_tokens
        if self.graphs is not None and all(
            w.n == 1 and w.samples and len(w.draft) == k and not w.snapshots for w in work
        ):
            # one new token per sequence (and its k drafts): a captured step, where one serves
            out = self.graphs.run(
                [w.request.slot for w in work],
                [w.start for w in work],
                [[w.request.all_ids[w.start], *w.draft] for w in work],
            )
            if out is not None:
                return out
        dev = self.state.block_table.device
        batch = Batch.build(
            [w.request.slot for w in work], [w.start for w in work], [w.length for w in work],
            self.state,
        )  # fmt: skip
        batch.snapshots = _snapshots(work)
        flat = torch.tensor(
            [t for w in work for t in w.request.all_ids[w.start : w.start + w.n] + w.draft],
            dtype=torch.long,
            device=dev,
        )
        h = None if self.pieces is None else self.pieces.run(flat, batch)
        if h is None:
            h = self.model(flat, batch, self.state)
        rows, off = [], 0
        for w in work:
            if w.samples:
                rows += range(off + w.n - 1, off + w.length)
            off += w.length
        return h, self.model.logits(h[torch.tensor(rows, dtype=torch.long, device=dev)])

    def _prompt_logprobs(self, work: list[Work], h: torch.Tensor) -> None:
        """SamplingParams.prompt_logprobs: each prompt token's logprob given the ones before
        it, from the logits of the token before (this step's rows of the prompt; a prefill step
        is eager, so `h` is here), and the top n; collected on the request."""
        rows, nxt, whose = [], [], []
        off = 0
        for w in work:
            r, n_prompt = w.request, len(w.request.prompt_ids)
            if r.params.prompt_logprobs is not None and w.start < n_prompt - 1:
                if w.start == 0:  # (again after a preemption)
                    r.extra["prompt_logprobs"] = [None]
                for i in range(w.n):
                    if w.start + i + 1 < n_prompt:
                        rows.append(off + i)
                        nxt.append(r.prompt_ids[w.start + i + 1])
                        whose.append(r)
            off += w.length
        if not rows:
            return
        dev = h.device
        lp = self.model.logits(h[torch.tensor(rows, dtype=torch.long, device=dev)]).log_softmax(-1)
        chosen = lp.gather(-1, torch.tensor(nxt, dtype=torch.long, device=dev)[:, None])
        rank = ((lp > chosen).sum(-1) + 1).tolist()  # 1 = the most likely token (vLLM's rank)
        chosen = chosen.squeeze(-1).tolist()
        k = max(r.params.prompt_logprobs for r in whose)
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        for j, (r, tok) in enumerate(zip(whose, nxt)):
            entry = {"token_id": tok, "logprob": chosen[j], "rank": rank[j]}
            n = r.params.prompt_logprobs
            if n:
                entry["top"] = list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist()))
            r.extra["prompt_logprobs"].append(entry)

    def _sample(
        self, work: list[Work], logits: torch.Tensor
    ) -> tuple[list[list[int]], list[list[dict]]]:
        """Each work's new tokens (its accepted drafts, then one sampled token) and their
        logprob entries. Round j verifies every work's draft j against the logits of the token
        before it (row j of the work's rows); a work leaves after its first rejection, or after
        the token past its last draft. Sets `accepted` on each work."""
        tokens: list[list[int]] = [[] for _ in work]
        entries: list[list[dict]] = [[] for _ in work]
        first = list(itertools.accumulate([1 + len(w.draft) for w in work], initial=0))
        active, j = list(range(len(work))), 0
        while active:
            reqs = [work[i].request for i in active]
            drafts = [work[i].draft[j] if j < len(work[i].draft) else -1 for i in active]
            sample = self.sampler(
                logits[[first[i] + j for i in active]],
                [r.params for r in reqs],
                [r.prompt_ids for r in reqs],
                [r.output_ids + tokens[i] for r, i in zip(reqs, active)],
                [r.extra["gen"] for r in reqs],
                drafts if self.num_speculative_tokens else None,
                [r.extra.get("constraint") for r in reqs],
            )
            ids = sample.token_ids.tolist()
            for k, (i, req) in enumerate(zip(active, reqs)):
                tokens[i].append(ids[k])
                if req.params.logprobs is not None:
                    entries[i].append(_logprob_entry(sample, k, ids[k], req.params.logprobs))
            accepted = [False] * len(ids) if sample.accepted is None else sample.accepted.tolist()
            active, j = [i for k, i in enumerate(active) if accepted[k]], j + 1
        # every rank computed the same logits; rank 0's draws decide, so the ranks never diverge
        if self.par.world_size > 1 and work:
            most = 1 + max(len(w.draft) for w in work)
            rows = [
                toks + [-1] * (most - len(toks)) for toks in tokens
            ]  # one upload, not one a row
            t = torch.tensor(rows, dtype=torch.long, device=logits.device)
            tokens = [[x for x in row if x >= 0] for row in self.par.broadcast(t).tolist()]
        for w, toks in zip(work, tokens):
            w.accepted = len(toks) - 1
            self.num_drafts += bool(w.draft)
            self.num_draft_tokens += len(w.draft)
            self.num_accepted_tokens += w.accepted
            for j in range(w.accepted):  # drafts are accepted in order: the first w.accepted
                self.num_accepted_per_pos[j] += 1
        return tokens, entries

    def _postprocess(
        self, work: list[Work], tokens: list[list[int]], logprobs: list[list[dict]]
    ) -> list[RequestOutput]:
        outs = []
        for w, toks, lps in zip(work, tokens, logprobs):
            req = w.request
            out: RequestOutput = req.extra["out"]
            detok = req.extra["detok"]
            res = req.extra["stop"].step(toks, detok.step if detok else (lambda ids: ""))
            toks = toks[: res.num_tokens]  # the tokens after a stop are dropped
            req.output_ids += toks
            out.delta_token_ids = toks  # a stop token stays in token_ids; its text does not
            out.token_ids = list(req.output_ids)
            out.delta_text = res.delta
            out.text += res.delta
            out.num_cached_tokens = req.num_cached
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs = req.extra.get("prompt_logprobs", [None])
            if out.logprobs is not None:
                out.logprobs += lps[: len(toks)]
            if res.finish_reason is None and len(req.output_ids) >= req.max_tokens:
                res.finish_reason = "length"
            if res.finish_reason is not None:
                req.finish_reason = out.finish_reason = res.finish_reason
                out.stop_reason = res.stop_reason
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)
            outs.append(out)
        return outs

    def _draft(self, work: list[Work], h: torch.Tensor) -> None:
        """Speculative decoding: the MTP layer runs over every position whose state this step
        kept (its window ring must hold them all), reading the main streams there and the token
        after; where a request decodes next, its last row drafts the next token, and the MTP
        layer, fed its own streams and that draft one position on, drafts the one after."""
        work = [w for w in work if w.request.slot is not None]  # (finished ones are freed)
        if not work:
            return
        dev = h.device
        first = list(itertools.accumulate([w.length for w in work], initial=0))
        lens = [w.n + w.accepted for w in work]
        rows = [r for w, f, n in zip(work, first, lens) for r in range(f, f + n)]
        nxt = [
            t for w, n in zip(work, lens) for t in w.request.all_ids[w.start + 1 : w.start + 1 + n]
        ]
        batch = Batch.build(
            [w.request.slot for w in work], [w.start for w in work], lens, self.state
        )
        batch.snapshots = _snapshots(work)  # (the MTP layer's window ring too)
        x = self.model.mtp_forward(
            h[torch.tensor(rows, dtype=torch.long, device=dev)],
            torch.tensor(nxt, device=dev),
            batch,
            self.state,
        )
        for w in work:
            w.request.draft = []
        # the requests that sampled this step (one token after their state), as many drafts as
        # fit before max_tokens with the token after them
        k = self.num_speculative_tokens
        last = list(itertools.accumulate(lens))
        drafting, want = [], []
        for i, w in enumerate(work):
            r = w.request
            n = min(k, r.max_tokens - len(r.output_ids) - 1)
            if r.num_computed == r.num_tokens - 1 and n > 0:
                drafting.append(i)
                want.append(n)
        if not drafting:
            return
        x = x[torch.tensor([last[i] - 1 for i in drafting], dtype=torch.long, device=dev)]
        reqs = [work[i].request for i in drafting]
        drafts: list[list[int]] = [[] for _ in reqs]
        # the drafts after the first run the MTP layer at positions the next step runs again
        # from its kept state: their ring rows are put back afterwards
        mtp = range(self.args.n_layers, self.args.n_layers + 1)
        ahead = [(r, d) for r, n in zip(reqs, want) for d in range(n - 1)]
        saved = self.state.save_rows(
            mtp, [r.slot for r, _ in ahead], [r.num_computed + d for r, d in ahead]
        )
        live, depth = list(range(len(reqs))), 0
        while True:
            d = self.par.broadcast(self.model.mtp_logits(x).argmax(-1))  # rank 0's, as tokens
            for i, t in zip(live, d.tolist()):
                drafts[i].append(t)
            more = [j for j, i in enumerate(live) if want[i] > depth + 1]
            if not more:
                break
            # one position on: the MTP layer's own streams in place of the main model's. Only
            # its window ring is written, so the position's page need not be allocated yet
            live = [live[j] for j in more]
            pick = torch.tensor(more, dtype=torch.long, device=dev)
            pos = [reqs[i].num_computed + depth for i in live]
            batch = Batch.build(
                [reqs[i].slot for i in live], pos, [1] * len(live), self.state, need_pages=False
            )
            x = self.model.mtp_forward(x[pick], d[pick], batch, self.state)
            depth += 1
        self.state.restore_rows(saved, [True] * len(ahead))
        for r, ds in zip(reqs, drafts):
            r.draft = ds


def _snapshots(work: list[Work]) -> tuple[tuple[int, int, int], ...]:
    """`Batch.snapshots` of a step's work: (sequence, position, snapshot index)."""
    return tuple((j, at, i) for j, w in enumerate(work) for at, i, _ in w.snapshots)


def _logprob_entry(sample: SampleOutput, k: int, tok: int, n: int) -> dict:
    """Row k's emitted token `tok` with its logprob and, if n, the n most likely tokens."""
    entry = {"token_id": tok, "logprob": float(sample.logprobs[k])}
    if n:
        entry["top"] = list(
            zip(sample.top_ids[k, :n].tolist(), sample.top_logprobs[k, :n].tolist())
        )
    return entry


class AsyncEngine:
    """Runs Engine.step() on a background thread; `generate` streams RequestOutputs per step.

    Callers never wait for a step: adds and aborts go into an inbox that the engine thread drains
    between steps (a lock shared with the stepping thread would starve an event loop).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # ("add", rid, ids, params) | ("abort", rid) | ("call", fn, future): fn() on this thread
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self.paused = False  # no steps (the inbox is still drained): running requests hold
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dsv4-engine")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._drain_inbox()  # also after stop: pending aborts free their state
            if self._stop:
                return
            try:
                work = self.engine.has_work() and not self.paused
                outs = self.engine.step() if work else None
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
            item = self._inbox.popleft()
            if item[0] == "call":
                _, fn, done = item
                try:
                    done.set_result(fn())
                except Exception as e:  # noqa: BLE001  (the caller's await raises it)
                    done.set_exception(e)
                continue
            kind, rid, *args = item
            if kind == "abort":
                req = self.engine.requests.get(rid)
                self.engine.abort(rid)  # no-op when finished or unknown
                if req is not None:  # a stream still read (`abort_all`) ends: finish_reason abort
                    out = req.extra["out"]
                    self._deliver(rid, dataclasses.replace(out, delta_token_ids=[], delta_text=""))
                continue
            prompt_ids, params, priority = args
            try:
                self.engine.add_request(prompt_ids, params, rid, priority)
            except Exception as e:  # refused (ValueError): the caller's generate raises it
                self._deliver(rid, e)

    def profile(self, action: str, *args: object) -> concurrent.futures.Future:
        """`Engine.profile` between steps, on the engine thread; the future gives rank 0's trace
        path or the ProfilerError."""
        return self.call(lambda: self.engine.profile(action, *args))

    def flush_cache(self) -> concurrent.futures.Future:
        """Drop the unheld cached prefixes between engine steps; the future gives how many."""
        return self.call(self.engine.flush_cache)

    def call(self, fn) -> concurrent.futures.Future:  # noqa: ANN001
        """fn() on the engine thread between steps; the future gives its result or exception."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(("call", fn, done))
        self._wake.set()
        return done

    def _fail_running(self, error: Exception) -> None:
        failed = EngineError(f"engine step failed: {error!r}")
        failed.__cause__ = error
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._deliver(rid, failed)

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is in flight (its id is taken)."""
        return request_id in self._queues

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, one per step; raises ValueError if the engine refuses it and
        EngineError if a step fails. Closing the generator aborts the request."""
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"duplicate request id {rid!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        self._inbox.append(("add", rid, list(prompt_ids), params, priority))
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

    def pause(self, paused: bool) -> concurrent.futures.Future:
        """Stop stepping (the running requests hold where they are) or go on; done between
        steps (once the future is done, no step runs until the engine goes on)."""
        return self.call(lambda: setattr(self, "paused", paused))

    def retract(self) -> concurrent.futures.Future:
        """`Engine.retract` between steps; the future gives how many."""
        return self.call(self.engine.retract)

    def abort_all(self) -> concurrent.futures.Future:
        """Abort every request the engine holds (each stream ends with finish_reason abort);
        the future gives how many."""

        def abort() -> int:
            rids = list(self.engine.requests)
            for rid in rids:
                self.abort(rid)
            return len(rids)

        return self.call(abort)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
