"""`dsv4 serve`'s app on the GPU with the default (auto) engine flags: CUDA graphs under the
server's engine thread. Apart from test_server.py, whose socket tests need the openai SDK."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import in_process

pytestmark = pytest.mark.gpu


def test_default_server_on_the_gpu(tmp_path):  # noqa: ANN001
    # warmed up at load; concurrent completions (two streamed) through the engine thread with
    # replayed graphs give the eager engine's greedy text
    d = make_tiny(tmp_path / "m", tiny_args(vocab_size=300), seed=2, tokenizer="bytes")
    server, client = in_process(d, max_seqs=4, max_seq_len=256)
    c = server.llm.config
    assert (c.device, c.dtype, c.ops, c.cuda_graphs) == ("cuda", "bfloat16", "triton", True)
    # warmed up before serving: a graph for every batch bucket at the first position bound
    assert set(server.llm.engine.graphs.graphs) == {(1, 256, 1), (2, 256, 1), (4, 256, 1)}
    prompts = ["Once upon a time", "hi", "The quick brown fox jumps", "a"]
    body = {"model": "m", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    async def one(ac: httpx.AsyncClient, prompt: str, stream: bool) -> str:
        if not stream:
            r = await ac.post("/v1/completions", json={**body, "prompt": prompt})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with ac.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
        return text

    async def go() -> tuple[list[str], str]:
        async with client as ac:
            texts = await asyncio.gather(*(one(ac, p, i % 2 == 1) for i, p in enumerate(prompts)))
            return list(texts), (await ac.get("/metrics")).text

    try:
        texts, metrics = asyncio.run(go())
    finally:
        server.shutdown()
    graphs = server.llm.engine.graphs
    assert graphs.graphs and not graphs.failed
    key = 'vllm:generation_tokens_total{model_name="m",engine="0"} '
    assert [float(x[len(key) :]) for x in metrics.splitlines() if x.startswith(key)] == [48]
    # the compiles these steps met after the warm-up are counted (and logged, by name)
    key = 'dsv4:late_compiles_total{model_name="m",engine="0"} '
    late = [float(x[len(key) :]) for x in metrics.splitlines() if x.startswith(key)]
    assert late == [server.late_compiles.count], late
    eager = LLM(d, max_seqs=4, max_seq_len=256, cuda_graphs=False, progress=False)
    want = eager.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert texts == [o.text for o in want]


def test_profiler_on_the_gpu(tmp_path):  # noqa: ANN001
    # /start_profile .. /stop_profile over replayed decode graphs: the trace (rank 0's, named
    # <id>-TP-0) holds the GPU's kernels, not only the host's ops
    import gzip
    from pathlib import Path

    d = make_tiny(tmp_path / "m", tiny_args(vocab_size=300), seed=2, tokenizer="bytes")
    server, client = in_process(d, max_seqs=4, max_seq_len=256, profile_dir=str(tmp_path / "p"))
    body = {"model": "m", "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with client as ac:
            started = await ac.post("/start_profile", json={})
            done = await ac.post("/v1/completions", json=body)
            return started, done, await ac.post("/stop_profile")

    try:
        started, done, stopped = asyncio.run(go())
    finally:
        server.shutdown()
    assert started.status_code == 200 and done.status_code == 200, (started.text, done.text)
    trace = Path(stopped.json()["trace"])
    assert trace.name.endswith("-TP-0.trace.json.gz"), trace
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), {e.get("cat") for e in events}
