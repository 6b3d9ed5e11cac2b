"""`dsv4 run-batch` (vLLM's run_batch): an OpenAI batch file through the server's routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.cli import main
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import in_process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_tiny(tmp_path_factory.mktemp("b") / "m", tiny_args(), seed=0, tokenizer="deepseek")


def test_run_batch(model_dir: Path, tmp_path: Path) -> None:
    # chat and completion requests answer as the server answers them (greedy), line for line in
    # the input's order; a request the route refuses keeps its status and error body; lines that
    # are no request get "response": null and an error naming what is wrong; nothing is dropped
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    comp = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "p1", "method": "POST", "url": "/v1/completions", "body": comp},
        {"custom_id": "bad-temp", "url": "/v1/completions", "body": {**comp, "temperature": -1}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "s", "method": "POST", "url": "/v1/completions", "body": {**comp, "stream": True}},
        {"method": "POST", "url": "/v1/completions", "body": comp},
        {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "max_tokens": 3}},
    ]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines[:5]) + "\n{not json\n"
                   + "\n".join(json.dumps(x) for x in lines[5:]) + "\n")  # fmt: skip
    flags = [
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--max-seqs",
        "4",
        "--max-seq-len",
        "256",
    ]
    assert main(["run-batch", "-i", str(src), "-o", str(out), *flags]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["c1", "p1", "bad-temp", "emb", "s", None, None, "c2"]
    assert len({g["id"] for g in got}) == len(got)

    import asyncio

    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)

    async def ask() -> list[dict]:
        async with ac:
            return [
                (await ac.post("/v1/chat/completions", json=chat)).json(),
                (await ac.post("/v1/completions", json=comp)).json(),
                (await ac.post("/v1/chat/completions", json={**chat, "max_tokens": 3})).json(),
            ]

    try:
        want = asyncio.run(ask())
    finally:
        server.shutdown()
    for g, w in zip([got[0], got[1], got[7]], want):
        assert g["error"] is None and g["response"]["status_code"] == 200
        body = g["response"]["body"]
        text = "message" in body["choices"][0]
        field = (lambda c: c["message"]["content"]) if text else (lambda c: c["text"])
        assert field(body["choices"][0]) == field(w["choices"][0])
        assert body["usage"] == w["usage"]
    assert got[2]["response"]["status_code"] == 400 and "temperature" in json.dumps(got[2]["error"])
    assert got[2]["response"].get("body") is None
    for g, why in zip(got[3:7], ["url must be one of", "cannot stream", "not JSON", "custom_id"]):
        assert g["response"] is None and why in g["error"]["message"], g


def test_run_batch_errors(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
