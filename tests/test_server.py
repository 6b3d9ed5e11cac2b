"""`dsv4 serve` over real sockets (openai SDK + httpx), plus in-process checks of the app."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from dsv4.chat import encode_messages, tool_call_prefix
from dsv4.config import ConfigError, speculative_tokens
from dsv4.engine import RequestOutput
from dsv4.metrics import Histogram
from dsv4.responses import ChatFormatter
from dsv4.server import main, parse_args
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import ServerProcess, in_process, scrape
from tests.test_config import EXACT, engine_flags
from tests.test_parsers import TOOLS as PARSER_TOOLS

MODEL = "tiny"  # served name: the checkpoint directory's name
MAX_LEN = 2048
BODY_LIMIT = 65536
HI = [{"role": "user", "content": "Hi there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # noqa: ANN001
    # real DeepSeek-V4 tokenizer: the chat format's special tokens are single ids
    return make_tiny(
        tmp_path_factory.mktemp("srv") / MODEL, tiny_args(), seed=0, tokenizer="deepseek"
    )


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    flags = ("--max-seqs", "64", "--max-seq-len", str(MAX_LEN), "--max-body-bytes", str(BODY_LIMIT))
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", *flags)
    yield srv
    srv.stop()
    log = srv.log.read_text()
    assert "ready: serving 'tiny' at http://127.0.0.1" in log  # the start-up line
    assert "tokens" in log and "weights loaded" in log  # state capacity and load lines


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def gauge(m: dict[str, float], name: str, **labels: str) -> float:
    lb = ",".join(
        [f'model_name="{MODEL}"', 'engine="0"'] + [f'{k}="{v}"' for k, v in labels.items()]
    )
    return m[f"{name}{{{lb}}}"]


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = [gauge(m, f"vllm:{k}") for k in ("num_requests_running", "num_requests_waiting")]
        if busy == [0, 0] and gauge(m, "vllm:kv_cache_usage_perc") == 0:
            return m
        assert time.monotonic() < deadline, f"not idle: {busy}, {m}"
        time.sleep(0.05)


def sse_events(lines) -> list:  # noqa: ANN001
    """Parsed `data:` payloads of an SSE line iterator ('[DONE]' kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the OpenAI surface ---------------------------------------------------------------------------


def test_health_models_version(server, client):  # noqa: ANN001
    assert server.health[-1] == 200 and set(server.health) <= {200, 503}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    # vLLM's /ping (GET and POST) and SGLang's /server_info answer as /health and /get_server_info
    assert httpx.get(server.url + "/ping").json() == httpx.post(server.url + "/ping").json()
    assert httpx.get(server.url + "/ping").json() == {"status": "ok"}
    assert (
        httpx.get(server.url + "/server_info").json()
        == httpx.get(server.url + "/get_server_info").json()
    )
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model" and card.max_model_len == MAX_LEN
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_string_and_token_prompts(server, client):  # noqa: ANN001
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, **GREEDY)
    (choice,) = r.choices
    assert r.object == "text_completion" and choice.finish_reason == "length"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert ids[0] == 0  # BOS, as /v1/completions prepends it
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        5,
        len(ids) + 5,
    )
    # the same ids as a token prompt give the same greedy text; list-of-one forms too
    for prompt in (ids, [ids]):
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
        assert again.choices[0].text == choice.text
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "<｜begin▁of▁sentence｜>Hello"


def test_n_choices_and_prompt_lists(server, client):  # noqa: ANN001
    # n choices per prompt and lists of prompts, as vLLM: choice index = prompt * n + j, usage
    # counting each prompt once; a seeded request's choice j draws with seed + j
    prompts = ["Hello", "The weather today"]
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY) for p in prompts
    ]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [single[i // 2].choices[0].text for i in range(4)]
    assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in single)
    assert r.usage.completion_tokens == 20
    kw = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a = client.completions.create(n=3, **kw)
    assert a.choices[0].text == client.completions.create(**kw).choices[0].text
    assert len({c.text for c in a.choices}) > 1  # the choices differ
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == [
        c.text for c in a.choices
    ]
    # streamed: the choices' chunks interleave; each index adds up to its text; usage at the end
    events = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    texts, finished, usage = ["", "", "", ""], set(), None
    for e in events:
        if e.usage is not None:
            usage = e.usage
            continue
        (c,) = e.choices
        texts[c.index] += c.text
        if c.finish_reason:
            finished.add(c.index)
    assert texts == [c.text for c in r.choices] and finished == {0, 1, 2, 3}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == r.usage.prompt_tokens
    chat = client.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_native_generate_as_sglang(server, client):  # noqa: ANN001
    # SGLang's POST /generate (what its bench_serving posts by default): text or input_ids,
    # sampling_params by SGLang's names; {text, output_ids, meta_info}; a stream repeats the body
    # with the text so far after every step, then [DONE]
    want = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, **GREEDY)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    r = httpx.post(server.url + "/generate", json={"text": "Hello", "sampling_params": sp})
    body = r.json()
    assert r.status_code == 200 and body["text"] == want.choices[0].text
    meta = body["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (want.usage.prompt_tokens, 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6} and len(body["output_ids"]) == 6
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    stream = httpx.post(
        server.url + "/generate",
        json={"input_ids": ids, "sampling_params": sp, "stream": True, "rid": "native-1"},
    )
    lines = [x[6:] for x in stream.text.splitlines() if x.startswith("data: ")]
    chunks = [json.loads(x) for x in lines[:-1]]
    assert lines[-1] == "[DONE]" and len(chunks) == 6
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert (
        chunks[-1]["text"] == want.choices[0].text and chunks[-1]["meta_info"]["id"] == "native-1"
    )
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(5))
    assert chunks[0]["meta_info"]["finish_reason"] is None
    # a stop token: finish_reason names it
    stop = {**sp, "stop_token_ids": [body["output_ids"][2]], "ignore_eos": False}
    got = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": stop})
    m = got.json()["meta_info"]
    assert m["finish_reason"] == {"type": "stop", "matched": body["output_ids"][2]}
    assert m["completion_tokens"] <= 3
    for bad, param in [
        ({"sampling_params": sp}, "text"),
        ({"text": "a", "input_ids": [1], "sampling_params": sp}, "text"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": "a", "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ({"text": "a", "lora_path": "x"}, "lora_path"),
        ({"text": [], "sampling_params": sp}, "text"),
        ({"text": ["a"] * 65, "sampling_params": {**sp, "n": 2}}, "sampling_params"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params"),
    ]:
        r = httpx.post(server.url + "/generate", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] and info["model_path"].endswith(MODEL)
    assert httpx.post(server.url + "/flush_cache").status_code == 200
    assert httpx.post(server.url + "/abort_request", json={"rid": "none"}).json() == {"rid": "none"}
    assert httpx.get(server.url + "/health_generate").json() == {"status": "ok"}


def test_chat_uses_the_deepseek_v4_prompt(server, client):  # noqa: ANN001
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, **GREEDY)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.message.tool_calls is None
    tok = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()
    assert r.usage.prompt_tokens == tok["count"] and r.usage.completion_tokens == 6
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert (
        prompt["prompt"]
        == encode_messages(HI)
        == "<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜></think>"
    )


def test_message_level_tools_and_response_format(server):  # noqa: ANN001
    # encoding_dsv4's system-message keys render in the prompt, and such tools are the ones the
    # reply's calls are parsed for; given twice (request and message) is a 400 naming tools
    schema = {"type": "object"}
    msgs = [{"role": "system", "content": "S", "tools": TOOLS, "response_format": schema}, *HI]
    tok = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert prompt["prompt"] == encode_messages(msgs) and "## Response Format:" in prompt["prompt"]
    r = httpx.post(server.url + CHAT, json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + CHAT, json={"messages": msgs, "tools": TOOLS, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools" and "given both" in err["message"]


def test_callable_tools():
    from dsv4.protocol import ChatCompletionRequest

    own = [{"role": "system", "tools": TOOLS}, *HI]
    for body, want in (
        ({"messages": HI}, None),
        ({"messages": HI, "tools": TOOLS}, TOOLS),
        ({"messages": own}, TOOLS),
        ({"messages": own, "tool_choice": "none"}, None),
        ({"messages": HI, "tools": TOOLS, "tool_choice": "none"}, None),
    ):
        req = ChatCompletionRequest(**body)
        assert req.callable_tools(req.encoder_options()) == want, body


def test_streaming_one_token_per_chunk_with_usage(server, client):  # noqa: ANN001
    extra = {"ignore_eos": True, "return_token_ids": True}
    kw = {"model": MODEL, "max_tokens": 7, "temperature": 0, "extra_body": extra}
    for kind in ("completions", "chat"):
        if kind == "completions":
            full = client.completions.create(prompt="Once upon", **kw)
            chunks = list(
                client.completions.create(
                    prompt="Once upon", stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            texts = [c.choices[0].text for c in chunks[:-1]]
            full_text = full.choices[0].text
        else:
            full = client.chat.completions.create(messages=HI, **kw)
            chunks = list(
                client.chat.completions.create(
                    messages=HI, stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            texts = [c.choices[0].delta.content or "" for c in chunks[:-1]]
            full_text = full.choices[0].message.content
        *tokens, last = chunks
        assert len(tokens) == 7 and all(len(c.choices[0].token_ids) == 1 for c in tokens)
        assert [c.choices[0].token_ids[0] for c in tokens] == full.choices[0].token_ids
        assert [c.choices[0].finish_reason for c in tokens] == [None] * 6 + ["length"]
        assert last.choices == [] and last.usage.completion_tokens == 7
        assert last.usage.prompt_tokens == full.usage.prompt_tokens
        assert "".join(texts) == full_text
    # the raw stream: data events, and [DONE] last
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert events[0]["object"] == "text_completion.chunk" and "usage" not in events[0]


def test_stop_strings_and_stop_token_ids(client):  # noqa: ANN001
    kw = {"model": MODEL, "prompt": "The weather today", **GREEDY}
    free = client.completions.create(max_tokens=12, **kw).choices[0]
    assert len(free.text) >= 6, free.text
    stop = free.text[3:6]
    out = client.completions.create(max_tokens=12, stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert out.model_extra["stop_reason"] == stop  # vLLM's field: what stopped it
    assert out.model_extra["matched_stop"] == stop  # SGLang's
    assert free.model_extra["matched_stop"] is None  # (max_tokens)
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, stop=stop, **GREEDY
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert stop not in (chat.choices[0].message.content or "")
    # a stop token id ends the output right there (its text is dropped, the token counted)
    extra = {"ignore_eos": True, "return_token_ids": True}
    ids = (
        client.completions.create(
            model=MODEL, prompt="The weather today", max_tokens=12, temperature=0, extra_body=extra
        )
        .choices[0]
        .token_ids
    )
    k = next(i for i, t in enumerate(ids) if t not in ids[:i] and i >= 2)
    r = client.completions.create(
        model=MODEL,
        prompt="The weather today",
        max_tokens=12,
        temperature=0,
        extra_body={**extra, "stop_token_ids": [ids[k]]},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == ids[: k + 1]
    assert r.choices[0].model_extra["stop_reason"] == ids[k]
    assert r.choices[0].model_extra["matched_stop"] == ids[k]
    assert r.usage.completion_tokens == k + 1


def test_seed_reproducibility(client):  # noqa: ANN001
    kw = {"model": MODEL, "prompt": "Pick a word:", "max_tokens": 8, "temperature": 1.0}
    a, b = (client.completions.create(seed=1234, **kw).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in range(1, 5)}
    assert len(others | {a}) > 1  # the seed matters
    c1, c2 = (
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=8, temperature=1.0, top_p=0.9, seed=7
        )
        .choices[0]
        .message.content
        for _ in range(2)
    )
    assert c1 == c2


def test_native_generate_logprobs_batches_and_n(server, client):  # noqa: ANN001
    # SGLang's /generate extensions that RL rollouts use: return_logprob (output_token_logprobs
    # as [logprob, token id, text], the top ones, the prompt's from logprob_start_len with None
    # for the first token), a batch of prompts and n > 1 (a list of bodies, prompt by prompt),
    # and a stream of several (each chunk with its index)
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The weather today"}).json()
    ids = ids["tokens"]
    want = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, logprobs=2, **GREEDY
    ).choices[0]
    lp = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    body = httpx.post(
        server.url + "/generate",
        json={"input_ids": ids, "sampling_params": sp, "logprob_start_len": 1, **lp},
    ).json()
    meta = body["meta_info"]
    out = meta["output_token_logprobs"]
    assert [x[1] for x in out] == body["output_ids"] and len(out) == 4
    assert [x[0] for x in out] == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
    assert [x[2] for x in out] == want.logprobs.tokens
    tops = meta["output_top_logprobs"]
    assert all(len(t) == 2 and t[0] == x for t, x in zip(tops, out))  # greedy: the top one
    assert [x[1] for x in meta["input_token_logprobs"]] == ids[1:]  # from logprob_start_len 1
    assert all(x[0] <= 0 for x in meta["input_token_logprobs"])
    assert len(meta["input_top_logprobs"]) == len(ids) - 1
    first = httpx.post(
        server.url + "/generate",
        json={"input_ids": ids, "sampling_params": sp, "return_logprob": True,
              "logprob_start_len": 0},
    ).json()["meta_info"]  # fmt: skip
    assert first["input_token_logprobs"][0] == [None, ids[0], None]
    assert first["input_token_logprobs"][1:] == [
        [x[0], x[1], None] for x in meta["input_token_logprobs"]
    ]
    assert "output_top_logprobs" not in first and "input_top_logprobs" not in first
    plain = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": sp})
    assert "output_token_logprobs" not in plain.json()["meta_info"]
    # a batch and n: a list, prompt by prompt, each as alone (greedy)
    texts = ["Hello", "Hi there"]
    alone = [
        httpx.post(server.url + "/generate", json={"text": t, "sampling_params": sp}).json()
        for t in texts
    ]
    many = httpx.post(
        server.url + "/generate",
        json={"text": texts, "sampling_params": {**sp, "n": 2}, "rid": ["a", "b"]},
    ).json()
    assert isinstance(many, list) and len(many) == 4
    assert [b["meta_info"]["id"] for b in many] == ["a-0", "a-1", "b-0", "b-1"]
    assert [b["text"] for b in many] == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2
    one = httpx.post(server.url + "/generate", json={"text": ["Hello"], "sampling_params": sp})
    assert isinstance(one.json(), list) and one.json()[0]["text"] == alone[0]["text"]
    batch_ids = httpx.post(
        server.url + "/generate", json={"input_ids": [ids, ids[:2]], "sampling_params": sp}
    ).json()
    assert batch_ids[0]["output_ids"] == body["output_ids"]
    assert batch_ids[1]["meta_info"]["prompt_tokens"] == 2
    stream = httpx.post(
        server.url + "/generate", json={"text": texts, "sampling_params": sp, "stream": True}
    )
    chunks = [json.loads(x[6:]) for x in stream.text.splitlines() if x.startswith("data: {")]
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1] and len(chunks) == 8
    assert [last[i]["text"] for i in (0, 1)] == [a["text"] for a in alone]


def test_logprobs(client):  # noqa: ANN001
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top raw logprob
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    assert bytes(content[0].bytes).decode() == content[0].token
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_prompt_logprobs(server, client, stream):  # noqa: ANN001
    # echo=true (what lm-eval's loglikelihood sends, with logprobs and max_tokens=1): the prompt
    # text first, and its tokens' logprobs (the first has none) before the completion's
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The weather today"}).json()
    ids = ids["tokens"]
    plain = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=1, logprobs=2, **GREEDY
    ).choices[0]
    kw = dict(model=MODEL, prompt="The weather today", max_tokens=1, logprobs=2, echo=True)
    if stream:
        (c,) = [e.choices[0] for e in client.completions.create(stream=True, **kw, **GREEDY)]
    else:
        c = client.completions.create(**kw, **GREEDY).choices[0]
    assert c.text == "The weather today" + plain.text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(plain.logprobs.token_logprobs[0], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.tokens[-1] == plain.logprobs.tokens[0]
    if stream:
        return
    # vLLM's prompt_logprobs field: the same logprobs, with ranks, keyed by token id
    ex = {"ignore_eos": True, "prompt_logprobs": 2}
    v = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=1, temperature=0, extra_body=ex
    ).choices[0]
    pl = v.model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        mine = pl[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-5)
        assert mine["rank"] >= 1 and sorted(x["rank"] for x in pl[i].values())[:2] == [1, 2]
    bad = {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}
    assert httpx.post(server.url + C, json=bad).json()["error"]["param"] == "prompt_logprobs"
    bad = {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "echo": True, "logprobs": 2}
    assert httpx.post(server.url + C, json=bad).json()["error"]["param"] == "prompt_logprobs"


def test_thinking_mode_gives_reasoning_content(server, client):  # noqa: ANN001
    thinking = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}
    kw = {"model": MODEL, "messages": HI, "max_tokens": 6, "temperature": 0}
    r = client.chat.completions.create(extra_body=thinking, **kw)
    msg = r.choices[0].message
    # the prompt ends inside <think>: a random model never closes it in 6 tokens
    assert msg.reasoning_content and msg.content is None
    # its tokens all reasoning: OpenAI's completion_tokens_details, SGLang's reasoning_tokens
    assert r.usage.completion_tokens_details.reasoning_tokens == 6 == r.usage.reasoning_tokens
    stream = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, extra_body=thinking, **kw
    ))  # fmt: skip
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream if c.choices
    )
    assert streamed == msg.reasoning_content
    assert stream[-1].usage.completion_tokens_details.reasoning_tokens == 6
    plain = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert plain.usage.completion_tokens_details is None  # (no reasoning part)
    tok = httpx.post(
        server.url + "/tokenize", json={"messages": HI, "chat_template_kwargs": {"thinking": True}}
    ).json()["tokens"]
    assert tok[-1] == 128821  # <think>
    # OpenAI's reasoning_effort turns thinking on too ("none" keeps it off)
    r2 = client.chat.completions.create(
        reasoning_effort="high", extra_body={"ignore_eos": True}, **kw
    )
    assert r2.choices[0].message.reasoning_content == msg.reasoning_content


def test_task_field(server, client):  # noqa: ANN001
    # SGLang's DeepSeek-V4 `task`: the prompt ends with the task's token (no answer's prefix),
    # and the output is content even in thinking mode; "action" comes after the prefix
    url = server.url + "/tokenize"
    tok = httpx.post(url, json={"messages": HI, "task": "query"}).json()["tokens"]
    assert tok[-1] == 128830 and 128804 not in tok[-2:]  # <｜query｜>, not <｜Assistant｜>
    act = httpx.post(url, json={"messages": HI, "task": "action",
                                "chat_template_kwargs": {"thinking": True}}).json()["tokens"]  # fmt: skip
    assert act[-3:] == [128804, 128821, 128829]  # <｜Assistant｜> <think> <｜action｜>
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, temperature=0,
        extra_body={"task": "domain", "ignore_eos": True, "chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.reasoning_content is None and msg.content
    bad = httpx.post(server.url + CHAT, json={"model": MODEL, "messages": HI, "task": "summary"})
    assert bad.status_code == 400


def test_response_format_json_object(server, client):  # noqa: ANN001
    # JSON mode: the reply is kept a JSON-object prefix (a random model rarely closes it in 24
    # tokens: only the prefix is checked; the closing and EOS: tests/test_grammar.py)
    from dsv4 import grammar

    kw = {"model": MODEL, "messages": HI, "max_tokens": 24, "temperature": 1.0, "seed": 3}
    fmt = {"type": "json_object"}
    texts = [client.chat.completions.create(response_format=fmt, **kw).choices[0].message.content]
    stream = client.chat.completions.create(response_format=fmt, stream=True, **kw)
    texts.append("".join(c.choices[0].delta.content or "" for c in stream))
    assert texts[0] == texts[1]  # seeded: streamed and whole agree
    assert grammar.advance((grammar.START, ()), texts[0].encode()) is not None, texts[0]
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert free != texts[0]
    r = httpx.post(
        server.url + CHAT, json={"messages": HI, "response_format": {"type": "json_schema"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    # on /v1/completions too (as vLLM): the text from the prompt on is one object's prefix
    body = {"prompt": "Reply in JSON:", "max_tokens": 24, "seed": 3, "response_format": fmt}
    text = httpx.post(server.url + C, json=body).json()["choices"][0]["text"]
    assert grammar.advance((grammar.START, ()), text.encode()) is not None, text
    # SGLang's structured-output keys on /generate are refused, not dropped
    r = httpx.post(server.url + "/generate",
                   json={"text": "hi", "sampling_params": {"structural_tag": "x"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params", r.text


def test_response_format_json_schema(server, client):  # noqa: ANN001
    # structured outputs: the reply stays inside the schema (a prefix of an instance: the random
    # model rarely finishes one) on chat, completions and /generate; a choice is finished at once;
    # what cannot be constrained to is a 400 naming the field and the keyword
    from dsv4.json_schema import compile_schema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
              "required": ["n", "s"]}  # fmt: skip
    auto = compile_schema(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    kw = {"model": MODEL, "messages": HI, "max_tokens": 24, "temperature": 1.0, "seed": 5}
    texts = [client.chat.completions.create(response_format=fmt, **kw).choices[0].message.content]
    stream = client.chat.completions.create(response_format=fmt, stream=True, **kw)
    texts.append("".join(c.choices[0].delta.content or "" for c in stream))
    texts.append(
        client.chat.completions.create(extra_body={"guided_json": schema}, **kw)
        .choices[0]
        .message.content
    )
    assert texts[0] == texts[1] == texts[2], texts
    body = {"prompt": "JSON:", "max_tokens": 24, "seed": 3, "structured_outputs": {"json": schema}}
    texts.append(httpx.post(server.url + C, json=body).json()["choices"][0]["text"])
    native = {
        "text": "JSON:",
        "sampling_params": {"json_schema": json.dumps(schema), "max_new_tokens": 24},
    }
    texts.append(httpx.post(server.url + "/generate", json=native).json()["text"])
    for text in texts:
        assert auto.advance(auto.START, text.encode()) != 0, text
    for body in (
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"guided_regex": "yes|no"},
        {"structured_outputs": {"regex": "(?:yes|no)"}},
        {"guided_grammar": 'root ::= "yes" | "no"'},
        {"structured_outputs": {"grammar": 'root ::= answer\nanswer ::= "yes" | "no"'}},
    ):
        r = httpx.post(server.url + CHAT, json={"messages": HI, "max_tokens": 8} | body).json()
        assert r["choices"][0]["message"]["content"] in ("yes", "no"), r
        assert r["choices"][0]["finish_reason"] == "stop", r
    for key, value in (("regex", "[0-9]{3}"), ("ebnf", "root ::= [0-9] [0-9] [0-9]")):
        native = {"text": "hi", "sampling_params": {key: value, "max_new_tokens": 8}}
        r = httpx.post(server.url + "/generate", json=native).json()
        assert re.fullmatch("[0-9]{3}", r["text"]), r
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
    bad = {"type": "object", "properties": {"d": {"type": "string", "format": "email"}}}
    for extra, param, words in (
        (
            {"response_format": fmt | {"json_schema": {"schema": bad}}},
            "response_format",
            "format 'email'",
        ),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "does not resolve"),
        ({"guided_json": schema, "guided_choice": ["a"]}, "guided_choice", "combined"),
        ({"guided_regex": "(?=a)b"}, "guided_regex", "'(?' group"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "rule 'x' is not defined"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        (
            {"response_format": fmt, "tools": TOOLS, "tool_choice": "required"},
            "response_format",
            "forced tool_choice",
        ),
    ):
        r = httpx.post(server.url + CHAT, json={"messages": HI} | extra)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text
    # thinking mode: the reasoning is free and the answer after `</think>` is constrained (here
    # `</think>` pushed up, so that the random model ends its reasoning at once); EOS cannot end
    # the reasoning
    think = {"messages": HI, "max_tokens": 16, "temperature": 0, "response_format": fmt,
             "chat_template_kwargs": {"thinking": True}}  # fmt: skip
    msg = httpx.post(server.url + CHAT, json=think | {"logit_bias": {"128822": 100}}).json()
    content = msg["choices"][0]["message"]["content"]
    assert content and auto.advance(auto.START, content.encode()) != 0, msg
    eos = tiny_args().eos_token_id
    r = httpx.post(server.url + CHAT, json=think | {"logit_bias": {str(eos): 100}}).json()
    assert (
        r["choices"][0]["finish_reason"] == "length" and not r["choices"][0]["message"]["content"]
    ), r
    r = httpx.post(
        server.url + "/generate", json={"text": "hi", "sampling_params": {"json_schema": "{"}}
    )
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], r.text


def test_tool_choice_named_and_required(server, client):  # noqa: ANN001
    # the reply is made to begin a DSML call (the prompt ends with chat.tool_call_prefix); the
    # random model's arguments are whatever it writes, so only the prompt and the errors are
    # checked here (the parsing: test_chat_formatter_forced_tool_call)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        body = {"messages": HI, "tools": TOOLS, "tool_choice": choice, "max_tokens": 4}
        r = httpx.post(server.url + CHAT, json=body | {"temperature": 0})
        assert r.status_code == 200, r.text
        text = encode_messages(HI, tools=TOOLS) + tool_call_prefix(
            "get_weather" if choice is named else None
        )
        ids = httpx.post(
            server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
        ).json()["tokens"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # thinking mode: the reasoning first, then the call's start forced after `</think>` (pushed
    # up here so that the random model ends its reasoning at once)
    think_end = 128822
    body = {"messages": HI, "tools": TOOLS, "tool_choice": named, "temperature": 0,
            "chat_template_kwargs": {"thinking": True}, "logit_bias": {str(think_end): 100},
            "return_token_ids": True}  # fmt: skip
    forced = httpx.post(
        server.url + "/tokenize",
        json={"prompt": tool_call_prefix("get_weather"), "add_special_tokens": False},
    ).json()["tokens"]
    r = httpx.post(server.url + CHAT, json=body | {"max_tokens": 1 + len(forced)})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [think_end, *forced]
    bad = [
        {
            "tool_choice": named,
            "chat_template_kwargs": {"thinking": True},
            "add_generation_prompt": False,
        },  # fmt: skip
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},  # not in tools
        {"tool_choice": {"type": "function"}},  # no name
    ]
    for extra in bad:
        r = httpx.post(server.url + CHAT, json={"messages": HI, "tools": TOOLS} | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_tool_choice_constrains_the_arguments(server, client):  # noqa: ANN001
    # the forced call's arguments follow the tool's schema (dsv4/dsml_grammar.py): the random
    # model writes a valid call and stops, in chat and thinking mode; a strict function whose
    # schema cannot be constrained to is a 400 naming tools
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3},
                                         "u": {"enum": ["a", "b"]}}, "required": ["n", "u"]}}}  # fmt: skip
    for choice in ({"type": "function", "function": {"name": "pick"}}, "required"):
        for think in (False, True):
            body = {"messages": HI, "tools": [pick, *TOOLS], "tool_choice": choice, "temperature": 0,
                    "max_tokens": 250, "parallel_tool_calls": False,
                    "chat_template_kwargs": {"thinking": think}}  # fmt: skip
            if think:  # (`</think>` pushed up: the random model ends its reasoning at once)
                body["logit_bias"] = {"128822": 100}
            if choice == "required":  # (the random model picks the function: make it pick)
                body["tools"] = [pick]
            r = httpx.post(server.url + CHAT, json=body, timeout=120).json()  # (250 tokens, CPU)
            (call,) = r["choices"][0]["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "pick" and args["n"] in (1, 2, 3), r
            assert args["u"] in ("a", "b") and r["choices"][0]["finish_reason"] == "tool_calls", r
    strict = {"type": "function", "function": {"name": "s", "strict": True, "parameters": {
        "type": "object", "properties": {"e": {"type": "string", "format": "email"}}}}}  # fmt: skip
    body = {"messages": HI, "tools": [strict], "tool_choice": "required"}
    r = httpx.post(server.url + CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    loose = {"type": "function", "function": strict["function"] | {"strict": False}}
    r = httpx.post(server.url + CHAT, json=body | {"tools": [loose], "max_tokens": 4})
    assert r.status_code == 200, r.text  # (not strict: that parameter's value is left free)


def test_continue_final_message_and_separate_reasoning(server, client):  # noqa: ANN001
    # vLLM's continue_final_message: the reply goes on from the final assistant message, the same
    # greedy tokens as a completion of that prompt; SGLang's separate_reasoning=false leaves the
    # reasoning in content
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}

    def completion_of(messages, **opts) -> str:  # noqa: ANN001, ANN003
        text = encode_messages(messages, add_generation_prompt=False, **opts)
        ids = httpx.post(
            server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
        ).json()["tokens"]
        body = kw | {"prompt": ids, "ignore_eos": True}
        return httpx.post(server.url + C, json=body).json()["choices"][0]["text"]

    cont = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    chat = HI + [{"role": "assistant", "content": "Sure, the"}]
    r = client.chat.completions.create(messages=chat, extra_body=cont, **kw)
    want = completion_of(chat, continue_final_message=True)
    assert r.choices[0].message.content == want and r.usage.completion_tokens == 6
    # in thinking mode, a final message with reasoning only: the reasoning goes on
    think = HI + [{"role": "assistant", "reasoning_content": "Let me", "content": ""}]
    tk = cont | {"chat_template_kwargs": {"thinking": True}}
    r = client.chat.completions.create(messages=think, extra_body=tk, **kw)
    want = completion_of(think, continue_final_message=True, thinking=True)
    assert r.choices[0].message.reasoning_content == want and r.choices[0].message.content is None
    # separate_reasoning=false: what thinking mode split off as reasoning comes back as content
    thinking = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}
    split = client.chat.completions.create(messages=HI, extra_body=thinking, **kw).choices[0]
    inline = client.chat.completions.create(
        messages=HI, extra_body=thinking | {"separate_reasoning": False}, **kw
    ).choices[0]
    assert split.message.reasoning_content and split.message.content is None
    assert inline.message.content == split.message.reasoning_content
    assert getattr(inline.message, "reasoning_content", None) is None
    # the request must leave the generation prompt out and end with an assistant message
    for extra, msgs in (({"continue_final_message": True}, chat), (cont, HI)):
        bad = httpx.post(server.url + CHAT, json={"messages": msgs, **extra})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "continue_final_message"


# ---- bad input ----------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = [
    # (id, method, path, body: dict | bytes, status, param)
    ("malformed-json", "POST", C, b'{"prompt": "hi",', 400, None),
    ("body-not-object", "POST", C, b"[1, 2]", 400, None),
    ("not-json-content-type", "POST", C, b"prompt=hi", 400, None),
    ("missing-prompt", "POST", C, {"max_tokens": 3}, 400, "prompt"),
    ("prompt-wrong-type", "POST", C, {"prompt": 5}, 400, "prompt"),
    ("max-tokens-wrong-type", "POST", C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature-negative", "POST", C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top-p-too-big", "POST", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top-k-invalid", "POST", C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("n-too-many", "POST", C, {"prompt": "hi", "n": 129}, 400, "n"),
    ("choices-too-many", "POST", C, {"prompt": ["a", "b", "c"], "n": 50}, 400, "prompt"),
    ("logprobs-too-many", "POST", C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("stop-wrong-type", "POST", C, {"prompt": "hi", "stop": 7}, 400, "stop"),
    ("seed-float", "POST", C, {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("bool-as-int", "POST", C, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    (
        "min-over-max-tokens",
        "POST",
        C,
        {"prompt": "hi", "min_tokens": 9, "max_tokens": 4},
        400,
        "min_tokens",
    ),  # fmt: skip
    (
        "stream-options-no-stream",
        "POST",
        C,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),  # fmt: skip
    ("empty-token-prompt", "POST", C, {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "POST", C, {"prompt": [0, 999999]}, 400, "prompt"),
    ("prompt-over-context", "POST", C, {"prompt": [5] * MAX_LEN}, 400, "prompt"),
    (
        "prompt-plus-max-tokens-over-context",
        "POST",
        C,
        {"prompt": [5] * 2000, "max_tokens": 100},
        400,
        "max_tokens",
    ),  # fmt: skip
    ("unknown-model", "POST", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("body-too-large", "POST", C, {"prompt": "x" * BODY_LIMIT}, 413, None),
    ("messages-wrong-type", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages-empty", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (
        "top-logprobs-without-logprobs",
        "POST",
        CHAT,
        {"messages": HI, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),  # fmt: skip
    (
        "bad-reasoning-effort",
        "POST",
        CHAT,
        {"messages": HI, "chat_template_kwargs": {"reasoning_effort": "ultra"}},
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    (
        "unknown-template-kwarg",
        "POST",
        CHAT,
        {"messages": HI, "chat_template_kwargs": {"thinkng": True}},
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    (
        "tool-without-name",
        "POST",
        CHAT,
        {"messages": HI, "tools": [{"type": "function", "function": {}}]},
        400,
        "tools",
    ),  # fmt: skip
    (
        "tool-choice-required",
        "POST",
        CHAT,
        {"messages": HI, "tool_choice": "required"},
        400,
        "tool_choice",
    ),  # fmt: skip
    ("logit-bias-key", "POST", C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit-bias-range", "POST", C, {"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("logit-bias-vocab", "POST", C, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, None),
    (
        "allowed-none",
        "POST",
        C,
        {"prompt": "hi", "allowed_token_ids": []},
        400,
        "allowed_token_ids",
    ),
    ("unknown-route", "GET", "/v1/nothing", b"", 404, None),
    ("wrong-method", "GET", C, b"", 405, None),
    ("detokenize-bad-id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize-nothing", "POST", "/tokenize", {}, 400, "prompt"),
]


def test_logit_bias_and_allowed_token_ids(server):  # noqa: ANN001
    # OpenAI's logit_bias (token ids as strings) and vLLM's allowed_token_ids steer the choice
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    forced = httpx.post(server.url + C, json=body | {"logit_bias": {"7": 100}}).json()
    assert forced["choices"][0]["token_ids"] == [7, 7, 7]
    only = httpx.post(server.url + C, json=body | {"allowed_token_ids": [9, 11]}).json()
    assert set(only["choices"][0]["token_ids"]) <= {9, 11}


def test_truncate_prompt_tokens(server):  # noqa: ANN001
    # vLLM's: only the prompt's last k tokens run (usage counts them; echo shows them)
    ids = list(range(10, 40))
    body = {"max_tokens": 2, "temperature": 0, "return_token_ids": True}
    cut = httpx.post(server.url + C, json=body | {"prompt": ids, "truncate_prompt_tokens": 5})
    same = httpx.post(server.url + C, json=body | {"prompt": ids[-5:]})
    assert cut.json()["usage"]["prompt_tokens"] == 5
    assert cut.json()["choices"][0]["token_ids"] == same.json()["choices"][0]["token_ids"]
    chat = {"messages": HI, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": 3}
    assert httpx.post(server.url + CHAT, json=chat).json()["usage"]["prompt_tokens"] == 3
    bad = httpx.post(server.url + C, json=body | {"prompt": ids, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_include_stop_str_in_output(server):  # noqa: ANN001
    # vLLM's flag keeps the matched stop string at the end of the text
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + C, json=body).json()["choices"][0]["text"]
    assert len(full) >= 5
    stop = full[3:5]
    i = full.find(stop)
    cut = httpx.post(server.url + C, json=body | {"stop": stop}).json()["choices"][0]
    kept = httpx.post(
        server.url + C, json=body | {"stop": stop, "include_stop_str_in_output": True}
    )
    kept = kept.json()["choices"][0]
    assert cut["text"] == full[:i] and kept["text"] == full[: i + len(stop)]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    # SGLang's name for it
    sg = httpx.post(server.url + C, json=body | {"stop": stop, "no_stop_trim": True})
    assert sg.json()["choices"][0]["text"] == kept["text"]


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])  # fmt: skip
def test_bad_input_gets_openai_error(server, method, path, body, status, param):  # noqa: ANN001
    if isinstance(body, bytes):
        headers = {"content-type": "text/plain" if body == b"prompt=hi" else "application/json"}
        r = httpx.request(method, server.url + path, content=body, headers=headers)
    else:
        r = httpx.request(method, server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert isinstance(err["type"], str) and err["type"]


def test_still_serving_after_bad_input(server, client):  # noqa: ANN001
    assert httpx.get(server.url + "/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:  # the SDK sees the envelope too
        client.completions.create(model=MODEL, prompt="ok", max_tokens=2, n=129)
    assert e.value.body["param"] == "n"
    wait_idle(server.url)


# ---- disconnects, concurrency, metrics ----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_frees_state(server, n):  # noqa: ANN001
    before = scrape(server.url)
    idle_usage = gauge(wait_idle(server.url), "vllm:kv_cache_usage_perc")
    body = {
        "prompt": "Tell me a long story",
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
        "n": n,  # (n > 1: every choice's request is aborted)
    }
    with httpx.stream("POST", server.url + C, json=body, timeout=30) as r:
        lines = r.iter_lines()  # held: dropping the iterator would close the connection here
        events = []
        while len(events) < 3:
            events += sse_events([next(lines)])
        m = scrape(server.url)
        assert gauge(m, "vllm:num_requests_running") == n
        assert gauge(m, "vllm:kv_cache_usage_perc") > idle_usage
    # the connection is gone: the request is aborted and its slot and pages are free again
    after = wait_idle(server.url)
    assert gauge(after, "vllm:kv_cache_usage_perc") == idle_usage == 0
    aborts = [
        gauge(x, "vllm:request_success_total", finished_reason="abort") for x in (before, after)
    ]
    assert aborts[1] == aborts[0] + n
    assert gauge(after, "vllm:generation_tokens_total") < gauge(before, "vllm:generation_tokens_total") + 1900  # fmt: skip


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_before_the_response_frees_state(server, n):  # noqa: ANN001
    before = scrape(server.url)
    body = {"prompt": "Tell me a long story", "max_tokens": 1900, "ignore_eos": True, "n": n}
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it runs
        httpx.post(server.url + C, json=body, timeout=httpx.Timeout(30, read=1.0))
    after = wait_idle(server.url)
    assert gauge(after, "vllm:kv_cache_usage_perc") == 0
    aborts = [
        gauge(x, "vllm:request_success_total", finished_reason="abort") for x in (before, after)
    ]
    assert aborts[1] == aborts[0] + n


def test_64_concurrent_streams(server):  # noqa: ANN001
    n, max_tokens = 64, 8
    extra = {"ignore_eos": True, "return_token_ids": True}
    before = scrape(server.url)

    async def run() -> tuple[list, list]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        kw = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "extra_body": extra}

        async def streamed(i: int) -> tuple[str, list[int], list, object]:
            stream = await aclient.completions.create(
                prompt=f"Request {i}:", stream=True, stream_options={"include_usage": True}, **kw
            )
            chunks = [c async for c in stream]
            *tokens, last = chunks
            text = "".join(c.choices[0].text for c in tokens)
            ids = [t for c in tokens for t in c.choices[0].token_ids]
            reasons = [c.choices[0].finish_reason for c in tokens]
            return text, ids, reasons, last

        async def whole(i: int):  # noqa: ANN202
            return await aclient.completions.create(prompt=f"Request {i}:", **kw)

        streams = await asyncio.gather(*(streamed(i) for i in range(n)))
        wholes = await asyncio.gather(*(whole(i) for i in range(n)))
        await aclient.close()
        return streams, wholes

    streams, wholes = asyncio.run(run())
    for (text, ids, reasons, last), full in zip(streams, wholes):
        # one token per chunk, exactly max_tokens of them, nothing lost or repeated
        assert len(ids) == max_tokens == len(reasons) and reasons[-1] == "length"
        assert last.choices == [] and last.usage.completion_tokens == max_tokens
        assert ids == full.choices[0].token_ids and text == full.choices[0].text
    after = wait_idle(server.url)
    made = gauge(after, "vllm:generation_tokens_total") - gauge(
        before, "vllm:generation_tokens_total"
    )
    assert made == 2 * n * max_tokens


def test_metrics_exposition(server):  # noqa: ANN001
    text = httpx.get(server.url + "/metrics").text
    m = scrape(server.url)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "time_per_output_token_seconds", "e2e_request_latency_seconds"):  # fmt: skip
        assert f"# TYPE vllm:{name} histogram" in text
        buckets = [v for k, v in m.items() if k.startswith(f"vllm:{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == gauge(m, f"vllm:{name}_count") > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"# TYPE vllm:{name} gauge" in text
    for name in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions"):
        assert f"# TYPE vllm:{name} counter" in text
    assert gauge(m, "vllm:request_success_total", finished_reason="length") >= 64
    assert gauge(m, "vllm:prompt_tokens_total") > 0


# ---- auth and a full queue (a second server) -----------------------------------------------------


def test_api_key_and_queue_full(model_dir, tmp_path):  # noqa: ANN001
    flags = (
        "--api-key",
        "sekrit",
        "--max-seqs",
        "1",
        "--max-queue",
        "1",
        "--served-model-name",
        "m",
    )
    srv = ServerProcess(model_dir, tmp_path / "server.log", *flags)
    try:
        url, key = srv.url, {"Authorization": "Bearer sekrit"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            r = httpx.post(url + C, json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers=key).json()["data"][0]["id"] == "m"
        for path in ("/generate", "/abort_request", "/flush_cache"):  # SGLang's native ones
            assert httpx.post(url + path, json={}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # not the generating routes
        assert httpx.get(url + "/metrics").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="m", prompt="hi", max_tokens=2).usage

        # one running, one waiting: the next is refused with 503 until the queue drains
        long = {
            "model": "m",
            "prompt": "go",
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }

        async def fill_then_overflow() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, headers=key, timeout=60) as ac:
                async with ac.stream("POST", C, json=long) as running:
                    lines = running.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass
                    waiting = asyncio.create_task(ac.post(C, json=long))
                    for _ in range(400):
                        m = await asyncio.to_thread(scrape, url)
                        if m['vllm:num_requests_waiting{model_name="m",engine="0"}'] == 1:
                            break
                        await asyncio.sleep(0.02)
                    refused = await ac.post(C, json={**long, "stream": False})
                    waiting.cancel()
                return refused

        refused = asyncio.run(fill_then_overflow())
        assert refused.status_code == 503, refused.text
        assert (
            refused.json()["error"]["code"] == 503 and "queue" in refused.json()["error"]["message"]
        )
        deadline = time.monotonic() + 20
        while (m := scrape(url))['vllm:num_requests_running{model_name="m",engine="0"}'] or m[
            'vllm:num_requests_waiting{model_name="m",engine="0"}'
        ]:
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert m['vllm:kv_cache_usage_perc{model_name="m",engine="0"}'] == 0
    finally:
        srv.stop()


# ---- in process: loading, engine failures, crashes ------------------------------------------------


def test_health_503_while_draining(model_dir):  # noqa: ANN001
    # from the exit signal on (uvicorn's handle_exit), /health and new requests get 503 while
    # the ones in flight drain; uvicorn's own handler still runs
    server, ac = in_process(model_dir, max_seqs=2, max_seq_len=256)
    seen = []

    class Http:  # (uvicorn.Server's part the server reads)
        started, servers = True, []

        def handle_exit(self, sig, frame) -> None:  # noqa: ANN001
            seen.append(sig)

    http = Http()
    server.attach(http)

    async def go() -> list[httpx.Response]:
        async with ac:
            before = await ac.get("/health")
            http.handle_exit(15, None)
            return [before, await ac.get("/health"), await ac.post(C, json={"prompt": "hi"})]

    try:
        before, after, completion = asyncio.run(go())
    finally:
        server.shutdown()
    assert before.status_code == 200 and seen == [15]
    assert after.status_code == 503 and after.json()["error"]["message"] == "shutting down"
    assert completion.status_code == 503


def test_health_503_while_loading():
    _, ac = in_process(None, api_key="secret")
    auth = {"Authorization": "Bearer secret"}

    async def go() -> list[httpx.Response]:
        async with ac:
            return [
                await ac.get("/health"),
                await ac.post(C, json={"prompt": "hi"}, headers=auth),
                await ac.get("/metrics"),
                await ac.get("/get_server_info"),
                await ac.post("/ping"),
            ]

    health, completion, metrics, info, ping = asyncio.run(go())
    assert ping.status_code == 503  # vLLM's /ping is /health
    # SGLang's server info: the settings without the key; no engine state yet
    assert info.json()["internal_states"] == [{}] and "api_key" not in info.json()
    assert health.status_code == 503 and health.json()["error"]["message"] == "the model is loading"
    assert completion.status_code == 503 and completion.json()["error"]["code"] == 503
    assert metrics.status_code == 200 and "vllm:prompt_tokens_total" in metrics.text


def test_api_key_guards_the_routes_that_change_state():
    # with --api-key, the routes that change weights, memory or generation need the key too
    # (they were open before this session); the read-only ones stay open
    _, ac = in_process(None, api_key="secret")
    auth = {"Authorization": "Bearer secret"}
    changing = [
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
    ]
    reading = ["/is_sleeping", "/get_weight_version", "/get_model_info"]

    async def go() -> tuple[list, list, list]:
        async with ac:
            bare = [await ac.post(r, json={}) for r in changing]
            keyed = [await ac.post(r, json={}, headers=auth) for r in changing]
            read = [await ac.get(r) for r in reading]
        return bare, keyed, read

    bare, keyed, read = asyncio.run(go())
    assert [r.status_code for r in bare] == [401] * len(changing)
    assert all(r.status_code != 401 for r in keyed), [r.status_code for r in keyed]
    assert all(r.status_code == 200 for r in read), [r.text for r in read]


def test_profiler_over_engine_steps(model_dir, tmp_path):  # noqa: ANN001
    # POST /start_profile and /stop_profile (vLLM's and SGLang's benchmarks' --profile): a
    # gzipped Chrome trace of the engine steps in between, or of num_steps steps
    import gzip

    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256, profile_dir=str(tmp_path))
    body = {"prompt": [0, 5, 6], "max_tokens": 4, "ignore_eos": True}

    async def go() -> tuple:
        async with ac:
            early = await ac.post("/stop_profile")
            started = await ac.post("/start_profile", json={})
            twice = await ac.post("/start_profile", json={})
            await ac.post(C, json=body)
            stopped = await ac.post("/stop_profile")
            other = tmp_path / "steps"
            counted = await ac.post(
                "/start_profile", json={"num_steps": 2, "output_dir": str(other)}
            )
            await ac.post(C, json=body)  # 4 steps: the trace is written after the second
            after = await ac.post("/stop_profile")
            bad = await ac.post("/start_profile", json={"num_steps": "two"})
            # SGLang's start_step: it begins after that many steps (so a stop before: cancelled)
            later = await ac.post("/start_profile", json={"start_step": 2, "num_steps": 1})
            cancel = await ac.post("/stop_profile")
            later = await ac.post("/start_profile", json={"start_step": 2, "num_steps": 1})
            await ac.post(C, json=body)  # steps 1, 2 pass; step 3 is traced; then it stops
            done = await ac.post("/stop_profile")
            return early, started, twice, stopped, counted, after, bad, later, cancel, done

    try:
        early, started, twice, stopped, counted, after, bad, later, cancel, done = asyncio.run(go())
    finally:
        server.shutdown()
    assert early.status_code == 400 and "not running" in early.json()["error"]["message"]
    assert started.status_code == 200 and twice.status_code == 400
    trace = Path(stopped.json()["trace"])
    assert trace == Path(started.json()["trace"]) and trace.name.endswith("-TP-0.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the steps' ops
    assert counted.status_code == 200 and Path(counted.json()["trace"]).exists()
    assert after.status_code == 400  # it had stopped by itself after 2 steps
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_steps"
    assert cancel.status_code == 400 and "cancelled" in cancel.json()["error"]["message"]
    assert later.status_code == 200 and Path(later.json()["trace"]).exists()
    assert done.status_code == 400  # (it had stopped by itself)
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)  # no --profile-dir

    async def nowhere() -> httpx.Response:
        async with ac:
            return await ac.post("/start_profile", json={})

    try:
        r = asyncio.run(nowhere())
    finally:
        server.shutdown()
    assert r.status_code == 400 and "--profile-dir" in r.json()["error"]["message"]


async def until(task: asyncio.Task, ready) -> None:  # noqa: ANN001
    """Poll (event loop free) until ready() or the task has ended."""
    while not task.done() and not ready():
        await asyncio.sleep(0.005)


def test_update_weights_from_disk(model_dir, tmp_path):  # noqa: ANN001
    # SGLang's RL weight sync: another checkpoint of the model loaded in place once the request
    # in flight has finished (all of it from the old weights), its version in meta_info and
    # /get_weight_version; abort_all_requests ends a running stream first; a bad path is a 400
    # with the weights unchanged
    other = make_tiny(tmp_path / "b", tiny_args(), seed=1, tokenizer="deepseek")
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    native = {"input_ids": [0, 5, 6, 7], "sampling_params": sp}
    long = {"input_ids": [0, 5, 6], "sampling_params": {**sp, "max_new_tokens": 40}}
    endless = {**long, "sampling_params": {**sp, "max_new_tokens": 200}, "stream": True}
    U = "/update_weights_from_disk"

    def running() -> bool:
        return server.active > 0

    async def go() -> dict:
        r = {}
        async with ac:
            r["before"] = (await ac.post("/generate", json=native)).json()
            inflight = asyncio.create_task(ac.post("/generate", json=long))
            await until(inflight, running)
            r["up"] = await ac.post(U, json={"model_path": str(other), "weight_version": "v2"})
            r["inflight"] = (await inflight).json()
            r["after"] = (await ac.post("/generate", json=native)).json()
            r["version"] = (await ac.get("/get_weight_version")).json()
            stream = asyncio.create_task(ac.post("/generate", json=endless))
            await until(stream, running)
            r["up2"] = await ac.post(
                U, json={"model_path": str(model_dir), "abort_all_requests": True}
            )
            r["stream"] = await stream
            r["back"] = (await ac.post("/generate", json=native)).json()
            r["long"] = (await ac.post("/generate", json=long)).json()
            r["bad"] = await ac.post(U, json={"model_path": str(tmp_path / "none")})
            r["typo"] = await ac.post(U, json={"path": str(other)})
            r["elsewhere"] = {  # (SGLang's other weight syncs: refused, naming what works)
                x: await ac.post(x, json={"serialized_named_tensors": ["x"]})
                for x in ("/update_weights_from_tensor", "/init_weights_update_group",
                          "/update_weights_from_distributed")
            }  # fmt: skip
            r["still"] = (await ac.post("/generate", json=native)).json()
        return r

    try:
        r = asyncio.run(go())
    finally:
        server.shutdown()
    assert r["up"].status_code == 200 and r["up"].json()["success"], r["up"].text
    assert r["after"]["output_ids"] != r["before"]["output_ids"]
    assert r["after"]["meta_info"]["weight_version"] == "v2" == r["version"]["weight_version"]
    assert r["inflight"]["output_ids"] == r["long"]["output_ids"]  # all from the first weights
    assert r["inflight"]["meta_info"]["weight_version"] == "default"
    assert r["up2"].json()["success"] and r["up2"].json()["num_paused_requests"] == 1
    chunks = [json.loads(x[6:]) for x in r["stream"].text.splitlines() if x.startswith("data: {")]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert len(chunks[-1]["output_ids"]) < 200
    assert r["back"]["output_ids"] == r["before"]["output_ids"]
    assert r["bad"].status_code == 400 and not r["bad"].json()["success"]
    assert "config.json" in r["bad"].json()["message"]
    assert r["typo"].status_code == 400
    for route, why in r["elsewhere"].items():
        assert why.status_code == 400 and not why.json()["success"], route
        assert "/update_weights_from_disk" in why.json()["message"], route
    assert r["still"]["output_ids"] == r["before"]["output_ids"]
    assert r["still"]["meta_info"]["weight_version"] == "v2"  # (a failed update keeps it)


def test_sleep_and_wake_up(model_dir):  # noqa: ANN001
    # vLLM's /sleep, /wake_up, /is_sleeping and SGLang's memory occupation routes: the request in
    # flight finishes before the sleep; requests are 503s while anything is asleep (the weights
    # woken first, then the state); awake again, the same answer; an unknown tag or level is a
    # 400 and leaves the server awake
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    native = {"input_ids": [0, 5, 6, 7], "sampling_params": sp}
    long = {"input_ids": [0, 5, 6], "sampling_params": {**sp, "max_new_tokens": 40}}

    async def go() -> dict:
        r = {}
        async with ac:
            r["before"] = (await ac.post("/generate", json=native)).json()
            inflight = asyncio.create_task(ac.post("/generate", json=long))
            await until(inflight, lambda: server.active > 0)
            r["sleep"] = await ac.post("/sleep", params={"level": 1})
            r["inflight"] = (await inflight).json()
            r["is"] = (await ac.get("/is_sleeping")).json()
            r["refused"] = await ac.post("/generate", json=native)
            r["weights"] = await ac.post("/wake_up", params={"tags": "weights"})
            r["refused2"] = await ac.post(
                "/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}
            )
            r["wake"] = await ac.post("/wake_up", params={"tags": ["kv_cache"]})
            r["is2"] = (await ac.get("/is_sleeping")).json()
            r["after"] = (await ac.post("/generate", json=native)).json()
            r["release"] = await ac.post("/release_memory_occupation", json={})
            r["refused3"] = await ac.post("/generate", json=native)
            r["resume"] = await ac.post("/resume_memory_occupation", json={"tags": None})
            r["after2"] = (await ac.post("/generate", json=native)).json()
            r["bad_tag"] = await ac.post(
                "/release_memory_occupation", json={"tags": ["cuda_graph"]}
            )
            r["bad_level"] = await ac.post("/sleep", params={"level": 3})
            r["is3"] = (await ac.get("/is_sleeping")).json()
            r["last"] = (await ac.post("/generate", json=native)).json()
        return r

    try:
        r = asyncio.run(go())
    finally:
        server.shutdown()
    assert r["sleep"].status_code == 200 and r["sleep"].json()["success"], r["sleep"].text
    assert len(r["inflight"]["output_ids"]) == 40
    assert r["is"] == {"is_sleeping": True} and r["is2"] == {"is_sleeping": False}
    assert r["refused"].status_code == 503 and "asleep" in r["refused"].text
    assert r["weights"].json()["message"] == "asleep: kv_cache"
    assert r["refused2"].status_code == 503 and "kv_cache released" in r["refused2"].text
    assert r["wake"].json()["message"] == "awake"
    assert r["after"]["output_ids"] == r["before"]["output_ids"]
    assert r["release"].json()["success"] and r["refused3"].status_code == 503
    assert r["resume"].json()["success"]
    assert r["after2"]["output_ids"] == r["before"]["output_ids"]
    assert r["bad_tag"].status_code == 400 and "cuda_graph" in r["bad_tag"].text
    assert r["bad_level"].status_code == 400 and "level must be 1 or 2" in r["bad_level"].text
    assert r["is3"] == {"is_sleeping": False}
    assert r["last"]["output_ids"] == r["before"]["output_ids"]


def test_pause_and_continue_generation(model_dir, tmp_path):  # noqa: ANN001
    # SGLang's RL loop: pause in place (the running request holds, new ones wait), update the
    # weights, continue (the held request goes on with the new weights from where it was); a
    # pause with mode abort ends the running request and new ones wait for continue; mode
    # retract frees the running request's state (memory released and resumed in between) and
    # it recomputes on continue
    other = make_tiny(tmp_path / "b", tiny_args(), seed=1, tokenizer="deepseek")
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    engine = server.llm.engine
    sp = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    long = {"input_ids": [0, 5, 6], "sampling_params": sp}

    def started() -> bool:  # a request has 3 tokens
        return any(len(q.output_ids) >= 3 for q in engine.requests.values())

    async def go() -> dict:
        r = {}
        async with ac:
            r["alone"] = (await ac.post("/generate", json=long)).json()
            held = asyncio.create_task(ac.post("/generate", json=long))
            await until(held, started)
            r["pause"] = (await ac.post("/pause_generation", json={"mode": "in_place"})).json()
            at = [len(q.output_ids) for q in engine.requests.values()]
            await asyncio.sleep(0.2)
            r["still"] = at == [len(q.output_ids) for q in engine.requests.values()]
            waiting = asyncio.create_task(ac.post("/generate", json=long))
            r["up"] = await ac.post("/update_weights_from_disk", json={"model_path": str(other)})
            await asyncio.sleep(0.1)
            r["waited"] = not waiting.done() and not held.done()
            r["cont"] = (await ac.post("/continue_generation")).json()
            r["held"], r["waiting"], r["at"] = (await held).json(), (await waiting).json(), at[0]
            r["back"] = await ac.post(
                "/update_weights_from_disk", json={"model_path": str(model_dir)}
            )
            running = asyncio.create_task(ac.post("/generate", json=long))
            await until(running, started)
            r["abort"] = (await ac.post("/pause_generation", json={})).json()
            r["running"] = (await running).json()
            later = asyncio.create_task(ac.post("/generate", json=long))
            await asyncio.sleep(0.1)
            r["later_waited"] = not later.done()
            await ac.post("/continue_generation")
            r["later"] = (await later).json()
            # retract: the running request's state freed and a sleep in between; on continue it
            # recomputes prompt + output and ends as it would have
            again = asyncio.create_task(ac.post("/generate", json=long))
            await until(again, started)
            r["retract"] = (await ac.post("/pause_generation", json={"mode": "retract"})).json()
            s = engine.scheduler
            r["retracted"] = (len(s.running), len(s.waiting), s.num_preemptions)
            r["release"] = await ac.post("/release_memory_occupation", json={})
            r["early"] = await ac.post("/continue_generation")  # (asleep: refused, still held)
            r["resume"] = await ac.post("/resume_memory_occupation", json={})
            await ac.post("/continue_generation")
            r["again"] = (await again).json()
            r["bad"] = await ac.post("/pause_generation", json={"mode": "later"})
        return r

    try:
        r = asyncio.run(go())
    finally:
        server.shutdown()
    assert r["pause"]["success"] and r["still"] and r["waited"], r
    assert r["up"].status_code == 200 and r["up"].json()["success"], r["up"].text
    assert r["cont"]["success"]
    alone, held, at = r["alone"]["output_ids"], r["held"]["output_ids"], r["at"]
    assert len(held) == 60 and held[:at] == alone[:at] and held != alone  # old, then new weights
    assert r["waiting"]["output_ids"] != alone  # sent during the pause: the new weights
    assert r["back"].json()["success"]
    assert r["abort"]["num_aborted_requests"] == 1
    assert r["running"]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert r["later_waited"] and r["later"]["output_ids"] == alone
    assert r["retract"]["success"] and r["retracted"][:2] == (0, 1) and r["retracted"][2] >= 1
    assert r["release"].status_code == 200 and r["resume"].status_code == 200, r["release"].text
    assert r["early"].status_code == 400 and "wake_up first" in r["early"].text
    assert r["again"]["output_ids"] == alone
    assert r["bad"].status_code == 400


def test_abort_request_ends_the_response(model_dir):  # noqa: ANN001
    # SGLang's /abort_request on a request in flight: its response ends at once with
    # finish_reason abort (it used to wait for an output that never came)
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    sp = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}

    async def go() -> tuple:
        async with ac:
            task = asyncio.create_task(
                ac.post("/generate", json={"input_ids": [0, 5], "sampling_params": sp, "rid": "x"})
            )
            await until(task, lambda: server.active > 0)
            aborted = await ac.post("/abort_request", json={"rid": "x"})
            return aborted, await asyncio.wait_for(task, 60)

    try:
        aborted, r = asyncio.run(go())
    finally:
        server.shutdown()
    assert aborted.json() == {"rid": "x"}
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "abort"} and meta["completion_tokens"] < 200


def test_reasoning_tokens_stop_at_think_end():
    # the tokens before `</think>`; all of them while it has not come
    from dsv4.engine import RequestOutput
    from dsv4.responses import usage_of

    class Tok:
        def token_to_id(self, text: str) -> int:
            return {"</think>": 9}[text]

    fmt = ChatFormatter("r", "m", Tok(), thinking=True)
    done = RequestOutput("r", [1, 2], token_ids=[4, 5, 6, 9, 7, 8])
    going = RequestOutput("r", [1, 2], token_ids=[4, 5])
    assert fmt.reasoning_tokens(done) == 3 and fmt.reasoning_tokens(going) == 2
    usage = usage_of([done, going], 2, [fmt, fmt])
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == 2
    assert "completion_tokens_details" not in usage_of([done])


def test_matched_stop_names_the_eos_token():
    from dsv4.engine import RequestOutput

    fmt = ChatFormatter("r", "m", None, eos_token_id=1)
    eos = RequestOutput("r", [5], token_ids=[7, 1], text="x", finish_reason="stop")
    assert fmt.final_choice(eos)["matched_stop"] == 1
    cut = RequestOutput("r", [5], token_ids=[7, 8], text="xy", finish_reason="length")
    assert fmt.final_choice(cut)["matched_stop"] is None


def test_client_request_ids(model_dir):  # noqa: ANN001
    # vLLM's request_id / SGLang's rid on the OpenAI routes: the response's id, the id
    # /abort_request takes; one in flight is refused with a 400, two different ones too
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    long = {"prompt": [0, 5], "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def go() -> tuple:
        async with ac:
            task = asyncio.create_task(ac.post(C, json=long | {"request_id": "mine"}))
            await until(task, lambda: server.active > 0)
            again = await ac.post(CHAT, json={"messages": HI, "max_tokens": 2, "rid": "mine"})
            aborted = await ac.post("/abort_request", json={"rid": "mine"})
            first = await asyncio.wait_for(task, 60)
            chat = await ac.post(CHAT, json={"messages": HI, "max_tokens": 2, "rid": "c1"})
            two = await ac.post(C, json={"prompt": "hi", "max_tokens": 2, "rid": "a",
                                         "request_id": "b"})  # fmt: skip
            empty = await ac.post(C, json={"prompt": "hi", "max_tokens": 2, "rid": ""})
            return again, aborted, first, chat, two, empty

    try:
        again, aborted, first, chat, two, empty = asyncio.run(go())
    finally:
        server.shutdown()
    assert again.status_code == 400 and "'mine' is already in use" in again.text
    assert aborted.json() == {"rid": "mine"}
    body = first.json()
    assert body["id"] == "mine" and body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 200
    assert chat.status_code == 200 and chat.json()["id"] == "c1"
    assert two.status_code == 400 and "give one" in two.text
    assert empty.status_code == 400


def test_engine_failure_and_crash_stay_contained(model_dir, monkeypatch):  # noqa: ANN001
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256)
    engine = server.llm.engine
    real_run, calls = engine._run, []

    def flaky(work):  # noqa: ANN001, ANN202 - the 1st and 3rd steps fail
        calls.append(len(work))
        if len(calls) in (1, 3):
            raise RuntimeError("injected step failure")
        return real_run(work)

    monkeypatch.setattr(engine, "_run", flaky)
    body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}

    async def go() -> tuple:
        async with ac:
            failed = await ac.post(C, json=body)  # step 1 fails: before any token
            stream = await ac.post(C, json={**body, "stream": True})  # step 3: mid-stream
            ok = await ac.post(C, json=body)
            monkeypatch.setattr(server.llm, "encode", lambda p: 1 / 0)
            crash = await ac.post(C, json=body)
            after = await ac.post(C, json={**body, "prompt": [0, 5, 6]})
            return failed, stream, ok, crash, after

    try:
        failed, stream, ok, crash, after = asyncio.run(go())
    finally:
        server.shutdown()
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    assert "injected" not in failed.text
    events = sse_events(stream.text.splitlines())
    assert "choices" in events[0] and events[1]["error"]["code"] == 500 and events[-1] == "[DONE]"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert crash.status_code == 500 and "ZeroDivision" not in crash.text
    assert crash.json()["error"]["message"] == "internal server error (logged on the server)"
    assert after.status_code == 200
    s = engine.scheduler
    assert not s.running and not s.waiting and len(s.free_pages) == server.llm.state.num_blocks


# ---- the chat stream formatter fed scripted model output ------------------------------------------

TOOLS = PARSER_TOOLS[:1]  # get_weather
SCRIPT = (
    "The user wants weather.</think>Let me check.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _outputs(pieces: list[str], finish_reason: str = "stop") -> list[RequestOutput]:
    outs, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        outs.append(
            RequestOutput(
                "r", [0, 1], list(range(i + 1)), text, finish_reason if last else None,
                delta_token_ids=[i], delta_text=piece,
            )
        )  # fmt: skip
    return outs


def _fold(chunks: list[dict]) -> dict:
    """What a client accumulates from chat chunks."""
    msg = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for c in chunks:
        (choice,) = c["choices"]
        d = choice["delta"]
        msg["reasoning_content"] += d.get("reasoning_content", "")
        msg["content"] += d.get("content", "")
        for call in d.get("tool_calls", []):  # the first delta names it, the arguments add up
            fn = msg["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            fn["name"] = call["function"].get("name", fn["name"])
            fn["arguments"] += call["function"].get("arguments", "")
    msg["finish_reason"] = chunks[-1]["choices"][0]["finish_reason"]
    return msg


def test_chat_formatter_reasoning_and_tool_calls_at_every_split():
    whole = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS).response(
        _outputs([SCRIPT])[-1]
    )
    (choice,) = whole["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (
        msg["reasoning_content"] == "The user wants weather." and msg["content"] == "Let me check."
    )
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    for size in range(1, len(SCRIPT) + 1):
        pieces = [SCRIPT[i : i + size] for i in range(0, len(SCRIPT), size)]
        fmt = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS)
        chunks = [fmt.chunk(out) for out in _outputs(pieces)]
        assert len(chunks) == len(pieces)  # one chunk per engine step, even when held back
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        folded = _fold(chunks)
        assert folded["reasoning_content"] == msg["reasoning_content"], size
        assert folded["content"] == msg["content"], size
        assert (
            folded["tool_calls"] == {0: call["function"]}
            and folded["finish_reason"] == "tool_calls"
        )


def test_chat_formatter_one_call_without_parallel_tool_calls():
    # OpenAI's parallel_tool_calls=false in "auto": the first call only, whole and streamed
    two = SCRIPT.replace("</｜DSML｜tool_calls>", "") + (
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    both = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS).response(_outputs([two])[-1])
    assert len(both["choices"][0]["message"]["tool_calls"]) == 2
    one = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS, parallel_tool_calls=False)
    (call,) = one.response(_outputs([two])[-1])["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    for size in (1, 7, len(two)):
        pieces = [two[i : i + size] for i in range(0, len(two), size)]
        fmt = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS, parallel_tool_calls=False)
        folded = _fold([fmt.chunk(out) for out in _outputs(pieces)])
        assert (
            folded["tool_calls"] == {0: call["function"]} and folded["content"] == "Let me check."
        )
        assert folded["finish_reason"] == "tool_calls"


def test_chat_formatter_without_tools_and_on_length():
    # no tools requested: DSML is plain content; a length cut keeps finish_reason "length"
    fmt = ChatFormatter("r", "m", None, thinking=False, tools=None)
    msg = fmt.response(_outputs(["Hi</think>", SCRIPT])[-1])["choices"][0]
    assert msg["finish_reason"] == "stop" and "<｜DSML｜tool_calls>" in msg["message"]["content"]
    cut = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS)
    chunks = [cut.chunk(o) for o in _outputs(["Still thinking", " about it"], "length")]
    assert _fold(chunks) == {
        "reasoning_content": "Still thinking about it",
        "content": "",
        "tool_calls": {},
        "finish_reason": "length",
    }


def test_chat_formatter_forced_tool_call():
    # tool_choice named / "required": the prompt ends with the DSML block's start
    # (chat.tool_call_prefix) and the formatter parses it ahead of the model's text, streamed at
    # every split and whole
    body = SCRIPT[SCRIPT.index('<｜DSML｜parameter name="city"') :]
    for name, rest in (("get_weather", body), (None, 'get_weather">\n' + body)):
        prefix = tool_call_prefix(name)
        fmt = ChatFormatter("r", "m", None, tools=TOOLS, prefill=prefix)
        whole = fmt.response(_outputs([rest])[-1])["choices"][0]
        (call,) = whole["message"]["tool_calls"]
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        for size in (1, 3, 7, len(rest)):
            pieces = [rest[i : i + size] for i in range(0, len(rest), size)]
            fmt = ChatFormatter("r", "m", None, tools=TOOLS, prefill=prefix)
            folded = _fold([fmt.chunk(o) for o in _outputs(pieces)])
            assert folded["content"] == "" and folded["finish_reason"] == "tool_calls", size
            assert folded["tool_calls"] == {0: call["function"]}, size


def test_chat_formatter_stream_reasoning_false():
    # SGLang's stream_reasoning=false: the reasoning arrives in one delta, in the chunk where the
    # answer starts (or the last chunk), and the chunks fold into the same message
    for size in range(1, len(SCRIPT) + 1):
        pieces = [SCRIPT[i : i + size] for i in range(0, len(SCRIPT), size)]
        live = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS)
        held = ChatFormatter("r", "m", None, thinking=True, tools=TOOLS, stream_reasoning=False)
        want = _fold([live.chunk(o) for o in _outputs(pieces)])
        chunks = [held.chunk(o) for o in _outputs(pieces)]
        assert len(chunks) == len(pieces) and _fold(chunks) == want, size
        with_reasoning = [c for c in chunks if c["choices"][0]["delta"].get("reasoning_content")]
        assert len(with_reasoning) == 1, size
        first_answer = next(c for c in chunks if c["choices"][0]["delta"].get("content"))
        assert with_reasoning[0] is first_answer, size
    # reasoning cut by the length limit: sent with the last chunk
    held = ChatFormatter("r", "m", None, thinking=True, stream_reasoning=False)
    chunks = [held.chunk(o) for o in _outputs(["Still thinking", " about it"], "length")]
    assert "reasoning_content" not in chunks[0]["choices"][0]["delta"]
    assert chunks[1]["choices"][0]["delta"]["reasoning_content"] == "Still thinking about it"


# ---- small units --------------------------------------------------------------------------------


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram("x", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 5.0):
        h.observe(v)
    lines = h.render({"model_name": 'a"b'})
    assert 'x_bucket{model_name="a\\"b",le="0.1"} 2' in lines
    assert 'x_bucket{model_name="a\\"b",le="1.0"} 3' in lines
    assert 'x_bucket{model_name="a\\"b",le="+Inf"} 4' in lines
    assert 'x_count{model_name="a\\"b"} 4' in lines


def test_max_model_len_auto_in_the_routes(model_dir):  # noqa: ANN001
    # the resolved length is what /v1/models reports and what requests are checked against
    server, ac = in_process(model_dir, max_seqs=2, max_seq_len=-1, max_total_tokens=300)
    limit = server.llm.config.max_seq_len
    assert limit >= 300 and limit % server.llm.state.block_size == 0

    async def go() -> tuple:
        async with ac:
            models = await ac.get("/v1/models")
            long = await ac.post(C, json={"prompt": [5] * (limit - 1), "max_tokens": 2})
            fits = await ac.post(C, json={"prompt": [5] * (limit - 2), "max_tokens": 2})
            return models, long, fits

    try:
        models, long, fits = asyncio.run(go())
    finally:
        server.shutdown()
    assert models.json()["data"][0]["max_model_len"] == limit
    assert long.status_code == 400 and fits.status_code == 200


def test_non_default_args():
    from dsv4.server import non_default_args

    c = parse_args(["--max-seqs", "3", "--api-key", "k", "--enforce-eager"])
    shown = non_default_args(c)
    assert shown["max_seqs"] == 3 and shown["api_key"] == "***" and "port" not in shown


def test_profile_dir_from_the_peers_variables(monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", "/tmp/sg")
    assert parse_args([]).profile_dir == "/tmp/sg"
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/tmp/vl")
    assert parse_args([]).profile_dir == "/tmp/vl"
    assert parse_args(["--profile-dir", "/x"]).profile_dir == "/x"


def test_serve_flags(capsys, caplog):  # noqa: ANN001
    c = parse_args(["--max-seqs", "3", "--port", "9000", "--api-key", "k", "--max-queue", "5"])
    assert (c.max_seqs, c.port, c.api_key, c.max_queue, c.host) == (3, 9000, "k", 5, "127.0.0.1")
    assert (
        c.model_name == "dsv4-demo"
        and parse_args(["--model", "/x/DeepSeek-V4"]).model_name == "DeepSeek-V4"
    )
    assert main(["--port", "70000"]) == 2 and "port must be" in capsys.readouterr().err
    # the engine flags' "auto" resolved at parse time (CPU here); a bad device fails at once
    assert engine_flags(c) == EXACT
    assert parse_args(["--dtype", "bfloat16", "--enforce-eager"]).dtype == "bfloat16"
    assert c.warmup and not parse_args(["--no-warmup"]).warmup  # GPU only: LLM.warmup
    assert main(["--device", "cuda"]) == 2 and "no CUDA device" in capsys.readouterr().err
    assert main(["--max-queue", "-1"]) == 2
    # the peers' names for the same settings
    peers = parse_args(["--max-model-len", "1024", "--max-num-seqs", "4", "--chunked-prefill-size",
                        "256", "--max-num-batched-tokens", "512", "--page-size", "512", "--tp-size",
                        "1"])  # fmt: skip
    assert (peers.max_seq_len, peers.max_seqs, peers.chunk_size) == (1024, 4, 256)
    assert parse_args(["--chunked-prefill-size", "-1"]).chunk_size is None  # SGLang: no chunks
    assert parse_args([]).chunk_size is None  # the step budget, as vLLM
    assert main(["--chunk-size", "0"]) == 2 and "chunk_size=0" in capsys.readouterr().err
    assert (peers.max_step_tokens, peers.block_size, peers.tensor_parallel_size) == (512, 512, 1)
    sg = parse_args(["--context-length", "2048", "--max-running-requests", "2"])
    assert (sg.max_seq_len, sg.max_seqs, sg.max_step_tokens, sg.block_size) == (2048, 2, 2048, None)
    assert (
        main(["--max-num-batched-tokens", "0"]) == 2
        and "max_step_tokens" in capsys.readouterr().err
    )
    # vLLM's / SGLang's DeepSeek-V4 launch commands as written: the model positional or
    # --model-path, --tp, the memory fraction, and the flags naming what dsv4 always does
    vl = parse_args(["/m/DeepSeek-V4-Flash", "--trust-remote-code", "--enable-auto-tool-choice",
                     "--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4",
                     "--gpu-memory-utilization", "0.9"])  # fmt: skip
    assert (vl.model, vl.gpu_memory_utilization) == ("/m/DeepSeek-V4-Flash", 0.9)
    sg = parse_args(["--model-path", "/m/x", "--tp", "1", "--mem-fraction-static", "0.85",
                     "--tool-call-parser", "deepseekv4", "--reasoning-parser", "deepseek-v4"])  # fmt: skip
    assert (sg.model, sg.tensor_parallel_size, sg.gpu_memory_utilization) == ("/m/x", 1, 0.85)
    for bad, why in (
        (["--tool-call-parser", "hermes"], "DSML tool calls only"),
        (["--reasoning-parser", "qwen3"], "<think> reasoning only"),
        (["/a", "--model", "/b"], "two models given"),
        (["--memory-fraction", "0.5", "--mem-fraction-static", "0.9"], "give one state budget"),
    ):
        assert main(bad) == 2 and why in capsys.readouterr().err, bad
    assert parse_args([]).scheduling_policy == "fcfs"
    # the peers' published DeepSeek-V4 launch lines (../shared/spec/serving-conventions.md 2.2)
    vllm_v4 = parse_args(["deepseek-ai/DeepSeek-V4-Flash", "--trust-remote-code", "--kv-cache-dtype",
                          "fp8", "--block-size", "256", "--tokenizer-mode", "deepseek_v4",
                          "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice",
                          "--reasoning-parser", "deepseek_v4", "--speculative-config",
                          '{"method":"mtp","num_speculative_tokens":2}'])  # fmt: skip
    assert (vllm_v4.kv_cache_dtype, vllm_v4.block_size) == ("fp8", 256)
    assert speculative_tokens(vllm_v4.speculative_config) == 2
    sglang_v3 = parse_args(["--model-path", "/m/v3", "--tp", "8", "--trust-remote-code",
                            "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                            "4"])  # fmt: skip
    assert speculative_tokens(sglang_v3.speculative_config) == 3
    assert sglang_v3.tensor_parallel_size == 8
    sglang_v4 = ["--trust-remote-code", "--model-path", "/m/v4", "--tp", "4", "--moe-runner-backend",
                 "flashinfer_mxfp4", "--speculative-algorithm", "NEXTN", "--mem-fraction-static",
                 "0.90", "--chunked-prefill-size", "4096", "--swa-full-tokens-ratio", "0.1",
                 "--reasoning-parser", "deepseek-v4", "--tool-call-parser", "deepseekv4"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        v4 = parse_args(sglang_v4)
    assert (v4.chunk_size, v4.gpu_memory_utilization, v4.tensor_parallel_size) == (4096, 0.9, 4)
    assert speculative_tokens(v4.speculative_config) == 3  # (SGLang's DeepSeek default: 3 steps)
    assert "--moe-runner-backend flashinfer_mxfp4: accepted, no effect" in caplog.text
    assert "--swa-full-tokens-ratio 0.1: accepted, no effect" in caplog.text
    assert parse_args(["--tp", "2", "--ep", "2", "--enable-expert-parallel", "-dp", "1"])
    caps = parse_args(["--max-total-tokens", "4096", "--kv-cache-memory-bytes", "1000000"])
    assert (caps.max_total_tokens, caps.max_memory) == (4096, 1000000)
    for bad, why in (
        (["--speculative-algorithm", "DSPARK"], "MTP layer only (EAGLE / NEXTN name it)"),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"], "one chain"),
        (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
          "--speculative-num-draft-tokens", "4"], "--speculative-num-steps + 1 = 3"),
        (["--speculative-num-steps", "2"], "need --speculative-algorithm"),
        (["--speculative-algorithm", "EAGLE", "--speculative-config", '{"method": "mtp"}'],
         "not both"),
        (["--tokenizer-mode", "mistral"], "DeepSeek-V4's chat format"),
        (["--data-parallel-size", "2"], "data parallelism is not built"),
        (["--tp", "2", "--ep", "4"], "over the --tensor-parallel-size ranks (2)"),
    ):  # fmt: skip
        assert main(bad) == 2 and why in capsys.readouterr().err, bad
    # SGLang's flags: higher values first unless --schedule-low-priority-values-first
    assert parse_args(["--enable-priority-scheduling"]).scheduling_policy == "priority-high-first"
    low = parse_args(["--enable-priority-scheduling", "--schedule-low-priority-values-first"])
    assert low.scheduling_policy == "priority"
    assert main(["--schedule-low-priority-values-first"]) == 2
    assert "needs --enable-priority-scheduling" in capsys.readouterr().err
    assert main(["--enable-priority-scheduling", "--scheduling-policy", "priority"]) == 2
    assert "not both" in capsys.readouterr().err
    assert parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    # waiting requests preempt outranked running ones: SGLang's threshold 10 under its flag
    # (--disable-priority-preemption: never), never under vLLM's policy unless a threshold is given
    assert parse_args(["--enable-priority-scheduling"]).priority_preemption_threshold == 10
    for flags, want in (
        (["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "3"], 3),
        (["--enable-priority-scheduling", "--disable-priority-preemption"], None),
        (["--scheduling-policy", "priority"], None),
        (["--scheduling-policy", "priority", "--priority-scheduling-preemption-threshold", "0"], 0),
        ([], None),
    ):
        assert parse_args(flags).priority_preemption_threshold == want, flags
    for bad, why in (
        (["--disable-priority-preemption"], "needs --enable-priority-scheduling"),
        (["--priority-scheduling-preemption-threshold", "5"], "needs a priority scheduling"),
        (["--scheduling-policy", "priority", "--priority-scheduling-preemption-threshold", "-1"],
         "must be >= 0"),
    ):  # fmt: skip
        assert main(bad) == 2 and why in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "lifo"])
    assert "invalid choice: 'lifo'" in capsys.readouterr().err
    # vLLM's --max-model-len auto: the longest sequence the budget holds (it needs one)
    assert parse_args(["--max-model-len", "auto", "--max-total-tokens", "512"]).max_seq_len == -1
    assert main(["--max-model-len", "auto"]) == 2
    assert "max_seq_len auto (--max-model-len auto)" in capsys.readouterr().err
    # underscore spellings, as vLLM accepts them (values untouched)
    under = parse_args(
        ["--max_model_len", "1024", "--max_num_seqs=3", "--served_model_name", "a_b"]
    )
    assert (under.max_seq_len, under.max_seqs, under.model_name) == (1024, 3, "a_b")
    # more of the peers' names: aliases, switches naming what dsv4 always does, the no-effect ones
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        more = parse_args(["--model-path", "/m/x", "--enable-metrics", "--enable-chunked-prefill",
                           "--disable-log-requests", "--skip-server-warmup", "--max-queued-requests",
                           "7", "--disable-radix-cache", "--disable-cuda-graph", "--kv-cache-dtype",
                           "fp8_e4m3", "--attention-backend", "fa3", "-q", "fp8",
                           "--load-format", "safetensors", "--tokenizer-path", "/m/x/"])  # fmt: skip
    assert (more.warmup, more.max_queue, more.enable_prefix_caching, more.cuda_graphs) == (
        False, 7, False, False,
    )  # fmt: skip
    assert more.kv_cache_dtype == "fp8" and parse_args([]).enable_prefix_caching
    assert "--attention-backend fa3: accepted, no effect" in caplog.text
    assert "--quantization fp8: accepted, no effect" in caplog.text
    for bad, why in (
        (["--chat-template", "t.jinja"], "DeepSeek-V4's own encoder"),
        (["--revision", "main"], "local checkpoint directory"),
        (["--load-format", "dummy"], "safetensors files"),
        (["--model", "/m/x", "--tokenizer", "/m/y"], "tokenizer.json from the checkpoint"),
    ):
        assert main(bad) == 2 and why in capsys.readouterr().err, bad


def test_priority_field(model_dir, client):  # noqa: ANN001
    # vLLM's `priority` (and SGLang's on /generate): refused with a 400 naming the flag under the
    # default fcfs policy; under --scheduling-policy priority each route hands it to the engine
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 1}
        )
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    server, ac = in_process(model_dir, max_seqs=2, max_seq_len=256, scheduling_policy="priority")
    engine, seen = server.engine, []
    real = engine.generate

    def spy(ids, params, rid=None, priority=0):  # noqa: ANN001, ANN202
        seen.append(priority)
        return real(ids, params, rid, priority)

    engine.generate = spy
    body = {"max_tokens": 2, "ignore_eos": True}

    async def go() -> list:
        async with ac:
            return [
                await ac.post(C, json=body | {"prompt": [0, 5, 6], "priority": -3}),
                await ac.post(CHAT, json=body | {"messages": HI, "priority": 7}),
                await ac.post("/generate", json={"input_ids": [0, 5], "priority": 2,
                                                 "sampling_params": {"max_new_tokens": 2}}),
                await ac.post("/generate", json={"input_ids": [0, 5]}),
                await ac.post(C, json=body | {"prompt": [0, 5], "priority": "high"}),
            ]  # fmt: skip

    try:
        replies = asyncio.run(go())
    finally:
        server.shutdown()
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 400], [r.text for r in replies]
    assert seen == [-3, 7, 2, 0]


def test_generation_config_defaults(model_dir, tmp_path):  # noqa: ANN001
    # the checkpoint's generation_config.json fills the sampling fields a request leaves unset
    # (vLLM's --generation-config auto, SGLang's --sampling-defaults model); a request's own
    # values win, temperature 0 stays greedy; --generation-config vllm keeps the OpenAI defaults
    import shutil

    from dsv4.protocol import model_sampling_defaults

    ckpt = tmp_path / "ckpt"
    shutil.copytree(model_dir, ckpt)
    (ckpt / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.95})
    )
    assert model_sampling_defaults(ckpt) == {"temperature": 0.6, "top_p": 0.95}
    assert model_sampling_defaults(model_dir) == {}  # (none in the demo checkpoint)
    for bad, why in (({"temperature": "hot"}, "temperature must be a number"),
                     ({"top_p": 2}, "top_p"), ([1], "not a JSON object")):  # fmt: skip
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            model_sampling_defaults(tmp_path)
    assert parse_args(["--sampling-defaults", "openai"]).generation_config == "vllm"
    assert parse_args(["--generation-config", str(ckpt)]).generation_config == str(ckpt)
    with pytest.raises(ConfigError, match="auto, vllm or a directory"):
        parse_args(["--generation-config", "/nowhere"])
    with pytest.raises(ConfigError, match="not both"):
        parse_args(["--generation-config", "vllm", "--sampling-defaults", "model"])

    body = {"max_tokens": 2, "ignore_eos": True}
    for flag, want in (("auto", [(0.6, 0.95), (0.0, 0.95), (1.0, 0.5)]),
                       ("vllm", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.5)])):  # fmt: skip
        server, ac = in_process(ckpt, max_seqs=2, max_seq_len=256, generation_config=flag)
        assert server.sampling_defaults == ({"temperature": 0.6, "top_p": 0.95} if flag == "auto"
                                            else {})  # fmt: skip
        seen = []
        real = server.engine.generate

        def spy(ids, params, rid=None, priority=0, real=real, seen=seen):  # noqa: ANN001, ANN202
            seen.append((params.temperature, params.top_p))
            return real(ids, params, rid, priority)

        server.engine.generate = spy

        async def go(ac=ac) -> list:
            async with ac:
                return [
                    await ac.post(C, json=body | {"prompt": [0, 5, 6]}),
                    await ac.post(CHAT, json=body | {"messages": HI, "temperature": 0}),
                    await ac.post(C, json=body | {"prompt": [0, 5], "temperature": 1.0,
                                                  "top_p": 0.5}),
                ]  # fmt: skip

        try:
            replies = asyncio.run(go())
        finally:
            server.shutdown()
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        assert seen == want, (flag, seen)


def test_global_seed(model_dir):  # noqa: ANN001
    # vLLM's --seed / SGLang's --random-seed: a request without a seed of its own draws the same
    # tokens from two servers started with the same seed
    assert parse_args(["--random-seed", "7"]).seed == 7 and parse_args([]).seed is None
    body = {"prompt": [0, 5, 6], "max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    texts = []
    for _ in range(2):
        server, ac = in_process(model_dir, max_seqs=2, max_seq_len=256, seed=7)

        async def go(ac=ac) -> httpx.Response:
            async with ac:
                return await ac.post(C, json=body | {"return_token_ids": True})

        try:
            r = asyncio.run(go())
        finally:
            server.shutdown()
        texts.append(r.json()["choices"][0]["token_ids"])
    assert texts[0] == texts[1]
