"""`dsv4 serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncEngine.

POST /v1/completions, /v1/chat/completions (JSON or SSE), GET /v1/models, /health, /metrics,
/version, POST /tokenize, /detokenize. The model loads on a thread after uvicorn starts, so
/health answers 503 until it is ready. Errors are OpenAI-shaped JSON (dsv4/protocol.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from dsv4 import __version__
from dsv4.asgi import ClientGone, RequestGate, SSEResponse, error_response, sse, until_disconnect
from dsv4.chat import THINK_END, encode_messages
from dsv4.config import AUTO_FLAGS, ConfigError, ServerConfig, resolve_engine
from dsv4.engine import AsyncEngine, EngineError, RequestOutput, check_prompt
from dsv4.metrics import CONTENT_TYPE, RequestTrace, ServerMetrics, StatsLogger
from dsv4.ops.device import CompileWatch
from dsv4.profiler import ProfilerError
from dsv4.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    MemoryTagsRequest,
    PauseGenerationRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    error_body,
    model_sampling_defaults,
)
from dsv4.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    NativeFormatter,
    usage_of,
)
from dsv4.sampling import SamplingParams

log = logging.getLogger("dsv4")


class Server:
    """The served model, its engine and metrics, and the request checks around them."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.llm = None  # dsv4.llm.LLM once loaded
        self.engine: AsyncEngine | None = None
        self.metrics = ServerMetrics(config.model_name)
        self.http = None  # uvicorn.Server when run by main(): ready only once it listens
        self.stopping = False
        self.failed = False
        self.weight_version = "default"  # SGLang's: set by /update_weights_from_disk
        # requests in flight, and a pending weight update (new requests wait until it is done)
        self.active = 0
        self.updating = False
        self.paused: str | None = None  # /pause_generation's mode until /continue_generation
        self._changed: asyncio.Condition | None = None
        self.sampling_defaults: dict = {}  # the checkpoint's (`model_sampling_defaults`)

    # ---- lifecycle -------------------------------------------------------------------------
    def load(self) -> None:
        from dsv4.cli import build_llm

        t0 = time.perf_counter()
        if self.config.seed is not None:  # (every device's default generator: unseeded draws)
            torch.manual_seed(self.config.seed)
        llm = build_llm(self.config)
        log.info("weights loaded from %s in %.1f s", llm.model_dir, time.perf_counter() - t0)
        where = self.config.generation_config
        if where != "vllm":
            self.sampling_defaults = model_sampling_defaults(
                llm.model_dir if where == "auto" else where
            )
        if self.sampling_defaults:
            log.info(
                "sampling defaults from the model's generation_config.json: %s (unset request "
                "fields take them; --generation-config vllm keeps the OpenAI defaults)",
                self.sampling_defaults,
            )
        if self.config.warmup and llm.config.device.startswith("cuda"):
            llm.warmup()  # kernels compiled and decode graphs captured before the first request
            # what the warm-up missed: logged, and counted on /metrics
            self.metrics.late_compiles = CompileWatch(log).install()
        llm.engine.on_step = self.metrics.iteration.observe  # (after the warm-up's steps)
        self.llm, self.engine = llm, AsyncEngine(llm.engine)

    async def load_in_background(self) -> None:
        try:
            await asyncio.to_thread(self.load)
        except Exception as e:
            if isinstance(e, ValueError | FileNotFoundError):  # config/checkpoint: one clear line
                log.error("loading the model failed: %s", e)
            else:
                log.exception("loading the model failed")
            self.failed = True
            if self.http is not None:
                self.http.should_exit = True
            return
        while self.http is not None and not self.http.started:
            await asyncio.sleep(0.05)
        log.info("ready: serving %r at %s", self.config.model_name, self.url())

    def url(self) -> str:
        host, port = self.config.host, self.config.port
        if self.http is not None and self.http.servers:  # the bound port (port 0 picks one)
            port = self.http.servers[0].sockets[0].getsockname()[1]
        return f"http://{host}:{port}"

    @property
    def ready(self) -> bool:
        started = self.http is None or self.http.started
        return self.engine is not None and started and not self.stopping

    @property
    def late_compiles(self) -> CompileWatch | None:
        return self.metrics.late_compiles

    def attach(self, http) -> None:  # noqa: ANN001  (uvicorn.Server)
        """Serve under uvicorn `http`: from SIGINT / SIGTERM on, new requests and /health get 503
        while the ones in flight drain (the peers' graceful exit)."""
        self.http = http
        handle_exit = http.handle_exit

        def on_exit(sig, frame) -> None:  # noqa: ANN001
            self.stopping = True
            handle_exit(sig, frame)

        http.handle_exit = on_exit

    def shutdown(self) -> None:
        self.stopping = True
        if self.late_compiles is not None:
            self.late_compiles.uninstall()
        if self.engine is not None:
            self.engine.shutdown()
            self.llm.close()  # tensor parallel: the other ranks stop

    # ---- requests in flight and weight updates ---------------------------------------------
    def _cond(self) -> asyncio.Condition:
        if self._changed is None:  # (made in the serving loop)
            self._changed = asyncio.Condition()
        return self._changed

    @property
    def held(self) -> bool:
        """Generation is paused with the running requests held (in place or retracted)."""
        return self.paused in ("in_place", "retract")

    async def enter(self) -> None:
        """A request starts: after any pending weight update, and while generation is not
        paused."""
        async with self._cond():
            await self._cond().wait_for(lambda: not self.updating and self.paused is None)
            if self.llm.engine.asleep:  # (sleep mode: until /wake_up)
                raise ApiError(503, self.llm.engine.asleep)
            self.active += 1

    async def pause(self, mode: str | None) -> int:
        """Pause generation in `mode` ("abort": end the running requests; "in_place": hold
        them; "retract": hold them with their state freed, to recompute on continue), or go on
        (None): how many it aborted."""
        async with self._cond():
            self.paused = mode
            self._cond().notify_all()
        await asyncio.wrap_future(self.engine.pause(self.held))
        if mode == "retract":  # (their state freed: they recompute on continue)
            await asyncio.wrap_future(self.engine.retract())
        if mode != "abort":
            return 0
        return await asyncio.wrap_future(self.engine.abort_all())

    async def leave(self) -> None:
        """A request has finished (its response sent, or its client gone)."""
        async with self._cond():
            self.active -= 1
            self._cond().notify_all()

    async def update_weights(self, path: str, abort_all: bool, version: str | None) -> int:
        """Load the checkpoint at `path` in place once no request is in flight (new ones wait;
        abort_all ends the running ones first): how many were aborted. ValueError if refused."""
        held = self.held  # (held requests go on with the new weights)
        t0 = time.perf_counter()
        reload = functools.partial(self.llm.reload_weights, path, held=held)
        aborted = await self.alone(reload, abort_all, held)
        if version is not None:
            self.weight_version = version
        log.info("weights reloaded from %s in %.1f s (version %s)", path,
                 time.perf_counter() - t0, self.weight_version)  # fmt: skip
        return aborted

    async def alone(self, fn, abort_all: bool = False, held: bool = False) -> int:  # noqa: ANN001
        """fn() on the engine thread once no request is in flight (new ones wait; abort_all
        ends the running ones first; held: requests paused in place stay): how many were
        aborted. fn's exception is raised here."""
        cond = self._cond()
        async with cond:
            await cond.wait_for(lambda: not self.updating)
            self.updating = True
        try:
            aborted = await asyncio.wrap_future(self.engine.abort_all()) if abort_all else 0
            if not held:
                async with cond:
                    await cond.wait_for(lambda: self.active == 0)
            await asyncio.wrap_future(self.engine.call(fn))
            return aborted
        finally:
            async with cond:
                self.updating = False
                cond.notify_all()

    # ---- checks ----------------------------------------------------------------------------
    def require_engine(self) -> AsyncEngine:
        if not self.ready:
            raise ApiError(503, "the model is loading" if not self.stopping else "shutting down")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            msg = f"model {name!r} does not exist; this server serves {self.config.model_name!r}"
            raise ApiError(404, msg, "model")

    def tokenizer(self, param: str):  # noqa: ANN201 - tokenizers.Tokenizer
        self.require_engine()
        if self.llm.tokenizer is None:
            raise ApiError(400, "the model has no tokenizer.json: send token ids", param)
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence may hold: the engine's (--max-model-len auto resolved at load)."""
        return self.llm.config.max_seq_len if self.llm is not None else self.config.max_seq_len

    def check_room(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        try:
            check_prompt(ids, self.llm.args.vocab_size, limit, generate=True)
        except ValueError as e:
            raise ApiError(400, str(e), param) from e
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {max_tokens} more",
                "max_tokens",
            )

    # ---- generation ------------------------------------------------------------------------
    async def respond(
        self,
        request: Request,
        jobs: list[tuple[list[int], SamplingParams]],
        fmts: list[Formatter | NativeFormatter],
        n: int,
        stream: bool,
        include_usage: bool,
        listed: bool = False,
        priority: int = 0,
    ) -> Response:
        """Run a request's choices (`jobs`: prompt ids and params, n per prompt; `fmts`: one
        formatter each): JSON when all finish, or SSE from the first token on, the choices'
        chunks interleaved as their steps come. listed (SGLang's /generate, whose formatters
        have an id each): the JSON is the list of the choices' bodies. priority: the choices'
        place under a priority scheduling policy."""
        engine = self.require_engine()
        cap = self.config.max_queue
        if cap is not None and engine.stats().num_waiting >= cap:
            raise ApiError(503, f"the queue is full ({cap} requests waiting); retry later")
        # the engine's request ids: the formatters' (a response's choices share its id: then
        # one per choice, <id>-<index>)
        rids = [f.id for f in fmts]
        if len(set(rids)) < len(rids):
            rids = [f"{rid}-{i}" for i, rid in enumerate(rids)]
        for rid in rids:  # (a client's own ids)
            if engine.has_request(rid):
                raise ApiError(400, f"request id {rid!r} is already in use", "rid")
        gens = [
            engine.generate(ids, params, rid, priority) for (ids, params), rid in zip(jobs, rids)
        ]
        traces = [self.metrics.track() for _ in gens]
        outs = _merge(gens, traces)
        streaming = False  # the SSE body owns `outs` (and the `leave`) from its first token on
        await self.enter()  # (the requests reach the engine once `outs` is read)
        try:
            if not stream:
                finals = await until_disconnect(request, _run_to_end(outs, len(gens)))
                if listed:
                    return JSONResponse([f.response(o) for f, o in zip(fmts, finals)])
                if len(jobs) == 1:
                    return JSONResponse(fmts[0].response(finals[0]))
                body = fmts[0].envelope(
                    [f.final_choice(o) for f, o in zip(fmts, finals)], None, False
                )
                return JSONResponse(body | {"usage": usage_of(finals, n, fmts)})
            first = await until_disconnect(request, anext(outs))
            streaming = True
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except ValueError as e:  # the engine refused the request (add_request)
            raise ApiError(400, str(e)) from e
        except EngineError as e:
            raise ApiError(500, "the engine failed while running this request") from e
        finally:
            if not streaming:
                await outs.aclose()
                await self.leave()
        return SSEResponse(
            _events(outs, first, fmts, n, include_usage, self.leave),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _merge(
    gens: list[AsyncIterator[RequestOutput]], traces: list[RequestTrace]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, output) of every step of every choice, as they come; each choice's trace sees
    its outputs. Closing it closes every choice's generator (their requests abort)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in gens[i]:
                await q.put((i, out))
            await q.put((i, None))
        except Exception as e:  # noqa: BLE001  (refused, or the engine failed: the caller raises)
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    live = len(gens)
    try:
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, Exception):
                raise item
            traces[i].observe(item)
            yield i, item
    finally:
        # first what needs no await: a response cut off (client gone) is cancelled, and every
        # await here raises at once. A pump's cancellation closes its generator (its abort)
        for t in traces:
            t.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_to_end(
    outs: AsyncIterator[tuple[int, RequestOutput]], n: int
) -> list[RequestOutput]:
    last: list = [None] * n
    async for i, out in outs:
        last[i] = out
    return last


async def _events(
    outs: AsyncIterator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
    fmts: list[Formatter],
    n: int,
    include_usage: bool,
    done: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """SSE body: one chunk per engine step of a choice (one token, more with speculative
    decoding), [usage chunk], [DONE]; `done` once the choices have ended."""
    last: list = [None] * len(fmts)
    try:
        i, out = first
        while True:
            last[i] = out
            yield sse(fmts[i].chunk(out))
            if all(o is not None and o.finished for o in last):
                break
            i, out = await anext(outs)
        if include_usage:
            yield sse(fmts[0].usage_chunk(usage_of(last, n, fmts)))
    except EngineError:
        yield sse(error_body(500, "the engine failed while running this request"))
    finally:
        await outs.aclose()
        await done()
    yield sse("[DONE]")


def _choices(
    prompts: list[list[int]], params: SamplingParams, n: int
) -> list[tuple[list[int], SamplingParams]]:
    """n choices per prompt, in order (choice index = prompt index * n + j; a seeded request's
    choice j draws with seed + j: `SamplingParams.choice`)."""
    return [(ids, params.choice(j)) for ids in prompts for j in range(n)]


def _first_loc(errors: list[dict]) -> tuple[str | None, str]:
    e = errors[0]
    if e.get("type") == "json_invalid":
        return None, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = f"{where}: {e.get('msg')}" if where else f"request body: {e.get('msg')}"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return param, msg + more


STATS_INTERVAL = 5.0  # seconds between the engine lines (vLLM's default)
# SGLang's default --priority-scheduling-preemption-threshold under --enable-priority-scheduling
SGLANG_PREEMPTION_THRESHOLD = 10


async def log_stats(server: Server) -> None:
    """vLLM's periodic engine line while the server is busy (`StatsLogger`)."""
    logger = StatsLogger(server.metrics)
    while True:
        await asyncio.sleep(STATS_INTERVAL)
        if server.engine is not None:
            for line in logger.lines(server.engine.stats(), time.monotonic()):
                log.info("%s", line)


def build_app(server: Server) -> FastAPI:
    """The ASGI app; `server` holds the model (loaded by the lifespan if not already)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        task = asyncio.create_task(server.load_in_background()) if server.engine is None else None
        stats = None if server.config.disable_log_stats else asyncio.create_task(log_stats(server))
        yield
        for t in (task, stats):
            if t is not None:
                t.cancel()
        server.shutdown()

    app = FastAPI(title="dsv4", version=__version__, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _apierror_response(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        param, msg = _first_loc(list(e.errors()))
        if "json" not in request.headers.get("content-type", "json"):
            msg = "the body must be JSON sent with 'Content-Type: application/json'"
        return error_response(400, msg, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error (logged on the server)")

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's liveness route, GET and POST)
    @app.post("/ping")
    async def health() -> JSONResponse:
        if not server.ready:
            return error_response(
                503, "shutting down" if server.stopping else "the model is loading"
            )
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = server.engine.stats() if server.engine is not None else None
        return Response(server.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name
    async def server_info() -> dict:
        """SGLang's: the settings (no API key) and internal_states[0], where its benchmark reads
        avg_spec_accept_length (tokens a verification yields, with speculative decoding)."""
        info = {k: v for k, v in dataclasses.asdict(server.config).items() if k != "api_key"}
        state: dict = {}
        stats = server.engine.stats() if server.engine is not None else None
        if stats is not None and stats.mean_accept_length is not None:
            state["avg_spec_accept_length"] = stats.mean_accept_length
        return info | {"version": __version__, "internal_states": [state]}

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> dict:
        c = server.config
        card = {
            "id": c.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dsv4",
            "root": str(server.llm.model_dir) if server.llm is not None else c.model,
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check()
        server.check_model(body.model)
        server.require_engine()
        prompts, texts = [], []  # texts: what echo puts first
        tok = server.llm.tokenizer

        def text_of(ids: list[int]) -> str:  # what echo shows of token ids
            return tok.decode(ids, skip_special_tokens=False) if tok else ""

        for prompt in body.prompts():
            if isinstance(prompt, str):
                server.tokenizer("prompt")
                whole = server.llm.encode(prompt)
                ids = body.truncate(whole)  # (vLLM's truncate_prompt_tokens: the last k)
                texts.append(prompt if len(ids) == len(whole) else text_of(ids))
            else:
                ids = body.truncate(prompt)
                if body.echo:  # a token prompt's text
                    texts.append(text_of(ids))
            server.check_room(ids, body.max_tokens, "prompt")
            prompts.append(ids)
        params = body.sampling_params(body.max_tokens, body.logprobs, server.sampling_defaults)
        n_prompt = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the prompt tokens' logprobs too
            n_prompt = body.logprobs
        if n_prompt is not None:
            params = dataclasses.replace(params, prompt_logprobs=n_prompt)
        rid = body.response_id("cmpl-")
        fmts = [
            CompletionFormatter(
                rid,
                server.config.model_name,
                server.llm.tokenizer,
                eos_token_id=server.llm.args.eos_token_id,
                continuous_usage=body.continuous_usage,
                return_token_ids=body.return_token_ids,
                index=i,
                echo=texts[i // body.n] if body.echo else None,
                prompt_logprobs=body.prompt_logprobs is not None,
            )
            for i in range(len(prompts) * body.n)
        ]
        jobs = _choices(prompts, params, body.n)
        return await server.respond(
            request, jobs, fmts, body.n, body.stream, body.include_usage, priority=body.priority
        )

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        server.check_model(body.model)
        tokenizer = server.tokenizer("messages")
        opts = body.encoder_options()
        # tool_choice "required" / named: the answer's forced start, after the prompt in chat mode,
        # forced by the sampler after `</think>` in thinking mode
        prefix, tool_calls = body.forced_tool(opts)
        body.check_structured(opts, prefix)
        after_thinking, prefix = (prefix, "") if opts["thinking"] else ("", prefix)
        ids = body.truncate(_encode_chat(tokenizer, body.messages, opts, prefix))
        max_tokens = body.max_completion_tokens or body.max_tokens
        server.check_room(ids, max_tokens, "messages")
        params = body.sampling_params(
            max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
            server.sampling_defaults,
        )  # fmt: skip
        think_end = tokenizer.token_to_id(THINK_END)
        if tool_calls is not None:  # the forced call's arguments under the tools' schemas
            after = (
                {"forced_after": (think_end, tokenizer.encode(after_thinking, add_special_tokens=False).ids)}
                if after_thinking else {}
            )  # fmt: skip
            params = dataclasses.replace(params, tool_calls=tool_calls, **after)
        elif opts["thinking"]:  # the reasoning free, a structured answer after `</think>`
            params = params.answer_after(think_end)
        rid = body.response_id("chatcmpl-")
        fmts = [
            ChatFormatter(
                rid,
                server.config.model_name,
                tokenizer,
                eos_token_id=server.llm.args.eos_token_id,
                thinking=body.output_in_reasoning(opts),
                stream_reasoning=body.stream_reasoning,
                prefill=prefix,
                tools=body.callable_tools(opts),
                parallel_tool_calls=body.parallel_tool_calls is not False,
                continuous_usage=body.continuous_usage,
                return_token_ids=body.return_token_ids,
                index=i,
            )
            for i in range(body.n)
        ]
        jobs = _choices([ids], params, body.n)
        return await server.respond(
            request, jobs, fmts, body.n, body.stream, body.include_usage, priority=body.priority
        )

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send exactly one of 'prompt' or 'messages'", "prompt")
        if body.prompt is not None:
            tokenizer = server.tokenizer("prompt")
            ids = tokenizer.encode(body.prompt, add_special_tokens=False).ids
            ids = [server.llm.args.bos_token_id] + ids if body.add_special_tokens else ids
        else:
            kw = body.chat_template_kwargs
            req = ChatCompletionRequest(
                messages=body.messages, tools=body.tools, chat_template_kwargs=kw, task=body.task
            )
            opts = {**req.encoder_options(), "add_generation_prompt": body.add_generation_prompt}
            ids = _encode_chat(server.tokenizer("messages"), body.messages, opts)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        server.check_model(body.model)
        tokenizer = server.tokenizer("tokens")
        vocab = server.llm.args.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # ---- SGLang's native routes (its bench_serving's default backend posts to /generate) ----
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        body.check()
        server.require_engine()
        field = "text" if body.text is not None else "input_ids"
        if body.text is not None:
            server.tokenizer("text")
        params = body.params()
        prompts = []
        for p in body.prompts():
            ids = server.llm.encode(p) if body.text is not None else list(p)
            server.check_room(ids, params.max_tokens, field)
            body.check_prompt(ids)
            prompts.append(ids)
        n = body.sampling_params.n
        jobs = _choices(prompts, params, n)
        several = len(jobs) > 1
        logprobs = (
            (body.logprob_start_len, body.top_logprobs_num, body.return_text_in_logprobs)
            if body.return_logprob
            else None
        )
        fmts = [
            NativeFormatter(
                rid, server.llm.args.eos_token_id, server.llm.tokenizer, logprobs,
                index=i if several and body.stream else None, version=server.weight_version,
            )
            for i, rid in enumerate(body.rids())
        ]  # fmt: skip
        return await server.respond(
            request, jobs, fmts, n, body.stream, False, listed=several or body.batch,
            priority=body.priority or 0,
        )  # fmt: skip

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> JSONResponse:
        """SGLang's: another checkpoint of this model, loaded in place (RL weight sync)."""
        server.require_engine()
        try:
            aborted = await server.update_weights(
                body.model_path, body.abort_all_requests, body.weight_version
            )
        except ValueError as e:
            return JSONResponse(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400
            )
        msg = f"weights loaded from {body.model_path} (version {server.weight_version})"
        return JSONResponse({"success": True, "message": msg, "num_paused_requests": aborted})

    @app.post("/update_weights_from_tensor")
    @app.post("/init_weights_update_group")
    @app.post("/update_weights_from_distributed")
    async def weight_sync_not_here(request: Request) -> JSONResponse:
        """SGLang's other weight-sync routes, refused with the reason and what works instead."""
        route = request.url.path
        why = (
            "its body carries pickled tensors (CUDA IPC handles), and unpickling a request body "
            "runs code; in process, LLM.update_weights_from_tensor takes the tensors"
            if route == "/update_weights_from_tensor"
            else "this server joins no trainer's process group (NCCL weight broadcast)"
        )
        msg = f"{route} is not supported: {why}. Use /update_weights_from_disk."
        return JSONResponse({"success": False, "message": msg}, status_code=400)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest) -> dict:
        """SGLang's: new requests wait until /continue_generation; mode "abort" ends the
        running ones, "in_place" holds them (for a weight update in between), "retract" holds
        them with their state freed (a sleep may come in between too)."""
        server.require_engine()
        aborted = await server.pause(body.mode)
        return {"success": True, "message": f"generation paused ({body.mode})",
                "num_aborted_requests": aborted}  # fmt: skip

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        server.require_engine()
        if server.llm.engine.asleep and server.paused is not None:  # (held requests stay held)
            raise ApiError(400, f"{server.llm.engine.asleep} before /continue_generation")
        await server.pause(None)
        return {"success": True, "message": "generation continues"}

    # ---- sleep mode: vLLM's /sleep, /wake_up, /is_sleeping; SGLang's memory occupation ----
    async def memory(fn, *args: object) -> None:  # noqa: ANN001
        # LLM.sleep / wake_up(*args) once no request is in flight (held ones stay: LLM.sleep
        # refuses running ones); its refusal a 400
        server.require_engine()
        try:
            await server.alone(functools.partial(fn, *args), held=server.held)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def sleep(level: int, tags: list[str] | None) -> None:
        await memory(server.llm.sleep, level, tags)

    async def wake_up(tags: list[str] | None) -> None:
        await memory(server.llm.wake_up, tags)

    @app.post("/sleep")
    async def sleep_route(level: int = 1) -> dict:
        """vLLM's: give back the memory of the weights (level 1: kept in host memory; 2:
        dropped, reload them after /wake_up) and of the state, once the requests in flight have
        finished; requests are 503s until /wake_up."""
        await sleep(level, None)
        return {"success": True, "message": f"asleep (level {level})"}

    @app.post("/wake_up")
    async def wake_up_route(tags: list[str] | None = Query(None)) -> dict:  # noqa: B008
        """vLLM's: take the memory back (`tags`: weights and / or kv_cache; default both)."""
        await wake_up(tags)
        asleep = server.llm.sleeping_tags
        return {"success": True, "message": f"asleep: {', '.join(asleep)}" if asleep else "awake"}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": server.llm is not None and server.llm.is_sleeping}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryTagsRequest) -> dict:
        """SGLang's: /sleep at level 1 for `tags` (default all), the weights kept in host
        memory."""
        await sleep(1, body.tags)
        return {"success": True, "message": "memory released"}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryTagsRequest) -> dict:
        """SGLang's: /wake_up for `tags` (default all)."""
        await wake_up(body.tags)
        return {"success": True, "message": "memory resumed"}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": server.weight_version}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        path = str(server.llm.model_dir) if server.llm is not None else server.config.model
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "weight_version": server.weight_version}  # fmt: skip

    @app.post("/abort_request")
    async def abort_request(body: dict) -> dict:
        """Abort request `rid` (a /generate rid or a completion's id); unknown ids are a no-op."""
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise ApiError(400, "rid must be a string", "rid")
        server.require_engine().abort(rid)
        return {"rid": rid}

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        """SGLang's: drop the cached prefixes no running request holds."""
        engine = server.require_engine()
        if engine.engine.scheduler.cache is None:
            return {"message": "nothing to flush: prefix caching is off (--enable-prefix-caching)"}
        n = await asyncio.wrap_future(engine.flush_cache())
        return {"message": f"Cache flushed: {n} cached blocks dropped"}

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """Liveness that generates one token (SGLang's deep health check)."""
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        engine = server.require_engine()
        await server.enter()  # (a weight update waits for it, and it for a weight update)
        gen = engine.generate([server.llm.args.bos_token_id], one)
        try:
            async for _ in gen:
                pass
        except EngineError:
            return error_response(503, "the engine failed to generate")
        finally:
            await gen.aclose()
            await server.leave()
        return JSONResponse({"status": "ok"})

    # ---- the torch profiler over engine steps (vLLM's and SGLang's benchmarks' --profile) ----
    @app.post("/start_profile")
    async def start_profile(body: dict | None = None) -> dict:
        """Body (all optional): output_dir (default --profile-dir), num_steps (default: until
        /stop_profile), start_step (SGLang's: engine steps to let pass first; default 0),
        activities (["CPU", "GPU"], SGLang's; default both on a GPU). Every rank writes its own
        trace; SGLang's merge_profiles (one merged file) is not built."""
        body = body or {}
        steps, acts = body.get("num_steps"), body.get("activities") or ["CPU", "GPU"]
        first = body.get("start_step", 0)
        for name, value in (("num_steps", steps), ("start_step", first)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
        if not isinstance(acts, list) or not set(acts) <= {"CPU", "GPU", "CUDA"}:
            raise ApiError(
                400, f"activities must be a list of CPU, GPU; got {acts!r}", "activities"
            )
        engine = server.require_engine()
        cuda = server.llm.config.device.startswith("cuda") and bool({"GPU", "CUDA"} & set(acts))
        out = body.get("output_dir") or server.config.profile_dir
        path = await _profiled(engine.profile("start", out, steps, cuda, first or 0))
        return {"message": "profiling started", "trace": str(path)}

    @app.post("/stop_profile")
    async def stop_profile() -> dict:
        path = await _profiled(server.require_engine().profile("stop"))
        return {"message": "profile written", "trace": str(path)}

    return RequestGate(app, server.config.api_key, server.config.max_body_bytes)


async def _profiled(done: concurrent.futures.Future) -> Path:
    """The engine thread's answer to a profiler request; its refusals are 400s."""
    try:
        return await asyncio.wrap_future(done)
    except ProfilerError as e:
        raise ApiError(400, str(e)) from e


def _encode_chat(tokenizer, messages: list[dict], opts: dict, prefix: str = "") -> list[int]:  # noqa: ANN001
    # prefix: text the reply is made to begin with (ChatCompletionRequest.forced_tool)
    try:
        prompt = encode_messages(messages, **opts) + prefix
    except ValueError as e:  # encoder messages start with the offending field
        field = str(e).split("[", 1)[0].split(" ", 1)[0]
        param = {
            "tools": "tools",
            "reasoning_effort": "chat_template_kwargs",
            "continue_final_message": "continue_final_message",
            "task": "task",
        }.get(field, "messages")
        raise ApiError(400, str(e), param) from e
    return tokenizer.encode(prompt, add_special_tokens=False).ids


# ---- command line ---------------------------------------------------------------------------


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """vLLM's / SGLang's parser flags name the formats dsv4 parses: DeepSeek-V4's DSML tool calls
    (V3.2's grammar) and DeepSeek's <think> reasoning. Another family is a ConfigError."""

    def key(name: str) -> str:
        return re.sub(r"[-_.]", "", name.lower())

    if tool_call_parser is not None and key(tool_call_parser) not in ("deepseekv4", "deepseekv32"):
        raise ConfigError(
            f"--tool-call-parser {tool_call_parser!r}: dsv4 parses DeepSeek-V4's DSML tool calls "
            "only (deepseek_v4 / deepseekv4 / deepseek_v32 name it)"
        )
    if reasoning_parser is not None and not key(reasoning_parser).startswith("deepseek"):
        raise ConfigError(
            f"--reasoning-parser {reasoning_parser!r}: dsv4 parses DeepSeek's <think> reasoning "
            "only (deepseek_v4 / deepseek-v4 / deepseek_r1 name it)"
        )


# vLLM's / SGLang's launch flags that name what dsv4 always does: accepted, so their
# DeepSeek-V4 commands run as written
ACCEPTED = {
    "trust_remote_code": "accepted (vLLM / SGLang): dsv4 runs no code from a checkpoint",
    "enable_auto_tool_choice": "accepted (vLLM): tool_choice 'auto' is always on",
    "enable_expert_parallel": "accepted (vLLM): the routed experts are always spread over the "
    "tensor-parallel ranks",
    "enable_chunked_prefill": "accepted (vLLM): prefills are always chunked (--chunk-size)",
    "enable_metrics": "accepted (SGLang): /metrics is always served",
    "disable_log_requests": "accepted (vLLM): dsv4 does not log requests",
}
# SGLang's priority switches (`_apply_peer_flags` maps them onto the scheduling policy)
SGLANG_PRIORITY = {
    "enable_priority_scheduling": "SGLang's: the priority policy with higher `priority` values "
    "first (--scheduling-policy priority-high-first)",
    "schedule_low_priority_values_first": "SGLang's: with --enable-priority-scheduling, lower "
    "values first (vLLM's order, --scheduling-policy priority)",
    "disable_priority_preemption": "SGLang's: with --enable-priority-scheduling, waiting "
    "requests never preempt running ones",
}
# and the flags choosing what dsv4 has no choice of (its own kernels, its own state layout):
# accepted with a warning
NO_EFFECT = {
    "moe_runner_backend": "dsv4 runs its own routed-expert kernels",
    "swa_full_tokens_ratio": "dsv4's sliding-window rings are one per sequence, the model's size",
    "attention_backend": "dsv4 runs its own attention kernels",
    "quantization": "dsv4 reads the formats the checkpoint's config names",
    "cuda_graph_max_bs": "dsv4 captures a decode graph for every batch size up to --max-seqs",
    "watchdog_timeout": "dsv4 has no step watchdog",
}
# and those naming what dsv4 cannot do: refused with the reason (not argparse's "unrecognized")
REFUSED = {
    "chat_template": "dsv4 formats chats with DeepSeek-V4's own encoder; a custom template is "
    "not supported",
    "revision": "dsv4 loads a local checkpoint directory (download the revision first)",
}
LOAD_FORMATS = ("auto", "safetensors")  # vLLM's --load-format values that name what dsv4 reads
TOKENIZER_MODES = ("auto", "hf", "slow", "deepseek_v4", "deepseek_v32")  # vLLM's, all one here
SGLANG_MTP = ("EAGLE", "NEXTN")  # SGLang's --speculative-algorithm names for a DeepSeek MTP layer
SGLANG_MTP_STEPS = 3  # its draft tokens for DeepSeek when --speculative-num-steps is not given


# the peers' flags that name something, each checked or mapped by `_apply_peer_flags`
NAMED = {
    "load_format": "vLLM's: auto or safetensors (the checkpoint's safetensors files)",
    "tokenizer": "vLLM's / SGLang's (--tokenizer-path): only the checkpoint directory itself "
    "(its tokenizer.json)",
    "tool_call_parser": "accepted when it names DeepSeek-V4's DSML tool calls (deepseek_v4, "
    "deepseekv4, deepseek_v32): the parser built in",
    "reasoning_parser": "accepted when it names a DeepSeek reasoning parser (deepseek_v4, "
    "deepseek-v4, deepseek_r1, ...): the <think> parsing built in",
    "tokenizer_mode": "vLLM's: auto, hf, slow, deepseek_v4 or deepseek_v32 accepted (the "
    "checkpoint's tokenizer.json and DeepSeek-V4's chat format always)",
    "speculative_algorithm": "SGLang's: EAGLE or NEXTN drafts with the checkpoint's MTP layer (as "
    "--speculative-config with method mtp)",
}
# and those that count something
COUNTS = {
    "speculative_num_steps": "SGLang's: draft tokens",
    "speculative_eagle_topk": "SGLang's: only 1",
    "speculative_num_draft_tokens": "SGLang's: --speculative-num-steps + 1 (one draft chain)",
}


def _peer_flags(p: argparse.ArgumentParser) -> None:
    """The peers' launch flags that map onto dsv4's (`_apply_peer_flags`)."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name, why in (ACCEPTED | SGLANG_PRIORITY).items():
        p.add_argument(flag(name), action="store_true", help=why)
    for name, why in NAMED.items():
        p.add_argument(flag(name), default=None, help=why)
    for name, why in NO_EFFECT.items():
        p.add_argument(flag(name), default=None, help=f"accepted, no effect: {why}")
    for name, why in REFUSED.items():
        p.add_argument(flag(name), default=None, help=f"refused: {why}")
    for name, why in COUNTS.items():
        p.add_argument(flag(name), type=int, default=None, help=why)
    p.add_argument(
        "--data-parallel-size", "-dp", "--dp-size", "--dp", type=int, default=1,
        help="vLLM's / SGLang's: only 1 (no data parallelism: run one server per replica)",
    )  # fmt: skip
    p.add_argument(
        "--expert-parallel-size", "--ep-size", "--ep", type=int, default=None,
        help="SGLang's: the tensor-parallel size (the routed experts are spread over those ranks)",
    )  # fmt: skip
    p.add_argument("-q", dest="quantization", default=None, help="vLLM's --quantization")
    p.add_argument("--tokenizer-path", dest="tokenizer", default=None, help="SGLang's --tokenizer")
    # SGLang's switches for what dsv4 turns off with its own flags
    p.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                   help="SGLang's: --no-enable-prefix-caching")  # fmt: skip
    p.add_argument("--disable-cuda-graph", dest="cuda_graphs", action="store_false",
                   help="SGLang's: --enforce-eager")  # fmt: skip


def _apply_peer_flags(ns: argparse.Namespace) -> None:
    """Check the peers' flags and set dsv4's from them (ConfigError naming what cannot run)."""
    check_parsers(ns.tool_call_parser, ns.reasoning_parser)
    _sglang_priority(ns)
    if ns.tokenizer_mode is not None and ns.tokenizer_mode not in TOKENIZER_MODES:
        raise ConfigError(
            f"--tokenizer-mode {ns.tokenizer_mode!r}: dsv4 reads the checkpoint's tokenizer.json "
            f"with DeepSeek-V4's chat format ({', '.join(TOKENIZER_MODES)} name it)"
        )
    if ns.data_parallel_size != 1:
        raise ConfigError(
            f"--data-parallel-size {ns.data_parallel_size}: data parallelism is not built; dsv4 "
            "splits one replica over --tensor-parallel-size ranks (run one server per replica)"
        )
    ep, tp = ns.expert_parallel_size, ns.tensor_parallel_size
    if ep is not None and ep not in (1, tp):
        raise ConfigError(
            f"--expert-parallel-size {ep}: dsv4 spreads the routed experts over the "
            f"--tensor-parallel-size ranks ({tp})"
        )
    for flag, why in REFUSED.items():
        if getattr(ns, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: {why}")
    if ns.load_format is not None and ns.load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"--load-format {ns.load_format!r}: dsv4 reads the checkpoint's safetensors files "
            f"({' / '.join(LOAD_FORMATS)} name it)"
        )
    for flag, why in NO_EFFECT.items():
        if getattr(ns, flag) is not None:
            log.warning("--%s %s: accepted, no effect (%s)", flag.replace("_", "-"),
                        getattr(ns, flag), why)  # fmt: skip
    if ns.speculative_algorithm is not None:
        if ns.speculative_config is not None:
            raise ConfigError("give --speculative-config or --speculative-algorithm, not both")
        ns.speculative_config = _sglang_speculative(ns)
    elif (ns.speculative_num_steps, ns.speculative_eagle_topk,
          ns.speculative_num_draft_tokens) != (None, None, None):  # fmt: skip
        raise ConfigError("the --speculative-* counts need --speculative-algorithm")


def _sglang_priority(ns: argparse.Namespace) -> None:
    """SGLang's priority switches as the scheduling policy and preemption threshold."""
    if ns.enable_priority_scheduling:
        if ns.scheduling_policy != "fcfs":
            raise ConfigError("give --scheduling-policy or --enable-priority-scheduling, not both")
        low = ns.schedule_low_priority_values_first
        ns.scheduling_policy = "priority" if low else "priority-high-first"
        if ns.disable_priority_preemption:
            ns.priority_preemption_threshold = None
        elif ns.priority_preemption_threshold is None:
            ns.priority_preemption_threshold = SGLANG_PREEMPTION_THRESHOLD
    elif ns.schedule_low_priority_values_first:
        raise ConfigError("--schedule-low-priority-values-first needs --enable-priority-scheduling")
    elif ns.disable_priority_preemption:
        raise ConfigError("--disable-priority-preemption needs --enable-priority-scheduling")


def _sglang_speculative(ns: argparse.Namespace) -> str:
    """SGLang's --speculative-algorithm EAGLE / NEXTN and its counts as vLLM's speculative
    config: the MTP layer drafting one chain of --speculative-num-steps tokens."""
    steps, topk, drafts = (
        ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens
    )  # fmt: skip
    if ns.speculative_algorithm.upper() not in SGLANG_MTP:
        raise ConfigError(
            f"--speculative-algorithm {ns.speculative_algorithm}: dsv4 drafts with the "
            f"checkpoint's MTP layer only ({' / '.join(SGLANG_MTP)} name it)"
        )
    if topk not in (None, 1):
        raise ConfigError(f"--speculative-eagle-topk {topk}: dsv4 drafts one chain (topk 1)")
    if steps is None:
        steps = drafts - 1 if drafts is not None else SGLANG_MTP_STEPS
    if drafts is not None and drafts != steps + 1:
        raise ConfigError(
            f"--speculative-num-draft-tokens {drafts}: with one draft chain it is "
            f"--speculative-num-steps + 1 = {steps + 1}"
        )
    return json.dumps({"method": "mtp", "num_speculative_tokens": steps})


def dashed(argv: list[str]) -> list[str]:
    """Long flags with underscores spelled with dashes, as vLLM accepts them (`--max_model_len
    8192`, `--max_model_len=8192`); values are left as they are."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out


def parse_args(argv: list[str]) -> ServerConfig:
    from dsv4.cli import _engine_flags

    p = argparse.ArgumentParser(prog="dsv4 serve", description="OpenAI-compatible HTTP server")
    p.add_argument(
        "model_dir", nargs="?", default=None, metavar="MODEL",
        help="checkpoint directory, as `vllm serve MODEL` (the same as --model)",
    )  # fmt: skip
    _engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the native generating routes",
    )
    p.add_argument("--served-model-name", default=None, help="model id (default: directory name)")
    p.add_argument(
        "--max-queue", "--max-queued-requests", type=int, default=None,
        help="waiting requests before 503s (SGLang's --max-queued-requests)",
    )  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    p.add_argument(
        "--profile-dir",
        default=os.environ.get("VLLM_TORCH_PROFILER_DIR")
        or os.environ.get("SGLANG_TORCH_PROFILER_DIR"),
        help="where POST /start_profile writes torch profiler traces (unless it sends "
        "output_dir); default: $VLLM_TORCH_PROFILER_DIR or $SGLANG_TORCH_PROFILER_DIR, as the "
        "peers read it",
    )
    p.add_argument(
        "--no-warmup",
        "--skip-server-warmup",
        dest="warmup",
        action="store_false",
        help="serve at once on a GPU: kernels compile and graphs capture on first use instead",
    )
    p.add_argument(
        "--seed", "--random-seed", type=int, default=None,
        help="vLLM's / SGLang's: seed the draws of requests that bring no seed of their own",
    )  # fmt: skip
    p.add_argument(
        "--generation-config",
        default="auto",
        help="vLLM's: auto (default) = the checkpoint's generation_config.json gives the "
        "sampling defaults of fields a request leaves unset; vllm = the OpenAI defaults only; "
        "or a directory holding a generation_config.json",
    )
    p.add_argument(
        "--sampling-defaults",
        choices=("model", "openai"),
        default=None,
        help="SGLang's: model = --generation-config auto, openai = --generation-config vllm",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic engine line (throughputs, running / waiting, state use, cache hits)",
    )
    _peer_flags(p)
    ns = p.parse_args(dashed(argv))
    _apply_peer_flags(ns)
    if ns.sampling_defaults is not None:
        if ns.generation_config != "auto":
            raise ConfigError("give --generation-config or --sampling-defaults, not both")
        ns.generation_config = "auto" if ns.sampling_defaults == "model" else "vllm"
    if ns.model_dir is not None:
        if ns.model is not None and ns.model != ns.model_dir:
            raise ConfigError(f"two models given: {ns.model_dir!r} and --model {ns.model!r}")
        ns.model = ns.model_dir
    if ns.tokenizer is not None and (
        ns.model is None or Path(ns.tokenizer).resolve() != Path(ns.model).resolve()
    ):
        raise ConfigError(
            f"--tokenizer {ns.tokenizer}: dsv4 reads tokenizer.json from the checkpoint "
            "directory (give the model's own directory, or leave it out)"
        )
    # the engine flags' "auto" filled in now, so a bad --device fails before the server starts
    fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)}
    fields |= resolve_engine(**{k: fields[k] for k in AUTO_FLAGS})
    return ServerConfig(**fields)


def non_default_args(config: ServerConfig) -> dict:
    """The settings that differ from `dsv4 serve`'s defaults (the API key masked)."""
    out = {}
    for f in dataclasses.fields(ServerConfig):
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default:
            out[f.name] = "***" if f.name == "api_key" else value
    return out


def main(argv: list[str]) -> int:
    import uvicorn

    try:
        config = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if int(os.environ.get("RANK", "0")):  # under torchrun: follow rank 0 inside LLM(), exit
        from dsv4.cli import build_llm

        build_llm(config)
        return 0

    log.info("non-default args: %s", non_default_args(config))  # (as vLLM prints them)
    server = Server(config)
    app = build_app(server)
    http = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, timeout_graceful_shutdown=5)
    )
    server.attach(http)
    log.info(
        "dsv4 %s: starting http://%s:%d; the model loads once it listens",
        __version__,
        config.host,
        config.port,
    )
    http.run()
    return 1 if server.failed else 0
