"""ASGI plumbing for dsv4/server.py: the key-and-size gate, the disconnect race, SSE responses."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsv4.protocol import error_body


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def sse(payload: dict | str) -> str:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await `awaitable`, cancelling it (the engine then aborts) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
    if work.cancelled():
        raise ClientGone()
    return work.result()


class SSEResponse(StreamingResponse):
    """text/event-stream whose body generator is closed however the response ends."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:  # client gone mid-stream: closing the generator aborts the request
            await self.body_iterator.aclose()


# the routes that generate or change state: they need the API key when the server has one
PROTECTED = (
    "/v1/",
    "/generate",
    "/abort_request",
    "/flush_cache",
    "/health_generate",
    "/start_profile",
    "/stop_profile",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/pause_generation",
    "/continue_generation",
    "/sleep",
    "/wake_up",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)


class RequestGate:
    """ASGI middleware: Bearer key on PROTECTED routes, then the whole body read up front (413
    if large)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:  # noqa: ANN001
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith(PROTECTED):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                key.strip().encode(), self.api_key.encode()
            ):
                msg = "invalid or missing API key: send 'Authorization: Bearer <key>'"
                return await error_response(401, msg)(scope, receive, send)
        too_large = error_response(413, f"request body exceeds {self.max_body_bytes} bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await too_large(scope, receive, send)
            more = msg.get("more_body", False)
        body: list[bytes] | None = [b"".join(chunks)]

        async def replay() -> dict:  # the body once, then the real channel (disconnects)
            nonlocal body
            if body is not None:
                msg, body = {"type": "http.request", "body": body[0], "more_body": False}, None
                return msg
            return await receive()

        return await self.app(scope, replay, send)
