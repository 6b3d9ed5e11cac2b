"""`dsv4 run-batch`: vLLM's run_batch. An OpenAI batch input file (JSON lines of
{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}) runs
through the server's own routes, in process and all at once (the engine batches them), and the
results go to an OpenAI batch output file, line for line in the input's order:

  {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}

A request the route refuses keeps its status code, with the route's error body under "error"
(as vLLM writes it); a line that is no request (not JSON, no custom_id, another URL or method, a
stream) gets "response": null and an "error" naming what is wrong. Nothing is dropped."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from pathlib import Path

import httpx

from dsv4.config import ConfigError

log = logging.getLogger("dsv4")

URLS = ("/v1/chat/completions", "/v1/completions")


def check_line(text: str) -> dict:
    """One input line as a request (custom_id, method, url, body); ValueError naming what is
    wrong."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(req, dict):
        raise ValueError("a line must be a JSON object")
    if not isinstance(req.get("custom_id"), str):
        raise ValueError("custom_id must be a string")
    if req.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {req.get('method')!r}")
    if req.get("url") not in URLS:
        raise ValueError(f"url must be one of {list(URLS)}, got {req.get('url')!r}")
    if not isinstance(req.get("body"), dict):
        raise ValueError("body must be a JSON object")
    if req["body"].get("stream"):
        raise ValueError("body.stream: a batch request cannot stream")
    return req


def _output(custom_id: str | None, response: dict | None, error: object) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


async def _one(client: httpx.AsyncClient, text: str) -> dict:
    try:
        req = check_line(text)
    except ValueError as e:
        custom_id = None
        try:  # (named when the line carries one)
            custom_id = json.loads(text).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            pass
        return _output(custom_id if isinstance(custom_id, str) else None, None,
                       {"code": "invalid_request", "message": str(e)})  # fmt: skip
    r = await client.post(req["url"], json=req["body"])
    body = r.json()
    rid = f"batch_{uuid.uuid4().hex}"
    if r.status_code == 200:
        return _output(
            req["custom_id"], {"status_code": 200, "request_id": rid, "body": body}, None
        )
    return _output(req["custom_id"], {"status_code": r.status_code, "request_id": rid}, body)


async def run_lines(app, lines: list[str]) -> list[dict]:  # noqa: ANN001  (an ASGI app)
    """Every input line's output, in order; the requests run concurrently."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as c:
        return list(await asyncio.gather(*(_one(c, text) for text in lines)))


def main(argv: list[str]) -> int:
    from dsv4.server import Server, build_app
    from dsv4.server import parse_args as serve_args

    p = argparse.ArgumentParser(
        prog="dsv4 run-batch",
        description="an OpenAI batch file through the server's routes, offline (vLLM's run_batch); "
        "the engine flags are `dsv4 serve`'s",
    )
    p.add_argument("-i", "--input-file", required=True, help="JSON lines of batch requests")
    p.add_argument("-o", "--output-file", required=True, help="JSON lines of their results")
    ns, rest = p.parse_known_args(argv)
    try:
        config = serve_args(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    src = Path(ns.input_file)
    if not src.is_file():
        print(f"error: {src}: no such file", file=sys.stderr)
        return 2
    lines = [x for x in src.read_text().splitlines() if x.strip()]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = Server(config)
    try:
        server.load()
        t0 = time.perf_counter()
        outs = asyncio.run(run_lines(build_app(server), lines))
    except (ValueError, FileNotFoundError) as e:  # config / checkpoint: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        server.shutdown()
    took = time.perf_counter() - t0
    Path(ns.output_file).write_text("".join(json.dumps(o) + "\n" for o in outs))
    done = [o for o in outs if o["error"] is None]
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in done)
    log.info("run-batch: %d requests, %d failed, %.1f s, %.1f output tok/s -> %s", len(outs),
             len(outs) - len(done), took, tokens / max(took, 1e-9), ns.output_file)  # fmt: skip
    return 0
