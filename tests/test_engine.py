"""Continuous batching: equals the transformers reference, survives preemption, frees on abort."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dsv4.engine import AsyncEngine
from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args
from tests.reference import hf_greedy, hf_model

ARGS = tiny_args(vocab_size=300)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_tiny(tmp_path_factory.mktemp("eng"), ARGS, seed=3, tokenizer="bytes")


@pytest.fixture(scope="module")
def prompts():  # noqa: ANN201
    g = torch.Generator().manual_seed(5)
    lens = (1, 3, 4, 9, 17, 26, 33, 41)
    return [torch.randint(2, 300, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def expected(ckpt, prompts):  # noqa: ANN001, ANN201
    hf = hf_model(ckpt)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def _assert_idle(llm: LLM) -> None:
    # every page free once the prefix cache (on by default) lets go of the blocks it keeps
    s = llm.engine.scheduler
    assert not s.running and not s.waiting and not llm.engine.requests
    llm.engine.flush_cache()
    assert sorted(s.free_pages) == list(range(llm.state.num_blocks))
    assert sorted(s.free_slots) == list(range(llm.state.max_seqs))
    assert (llm.state.block_table == -1).all()


def test_batch_of_8_equals_transformers_greedy(ckpt, prompts, expected):  # noqa: ANN001
    # small budget and chunks: prefills are chunked and interleaved with running decodes
    llm = LLM(ckpt, progress=False, max_seqs=8, max_step_tokens=16, chunk_size=7, block_size=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    _assert_idle(llm)


def test_steps_that_sample_nothing(ckpt, prompts, expected):  # noqa: ANN001
    # one sequence at a time in chunks of 3: its first steps are prefill chunks alone, with no
    # logits to take
    llm = LLM(ckpt, progress=False, max_seqs=1, chunk_size=3, block_size=16)
    assert len(prompts[-1]) > 3
    assert llm.generate(prompts[-1], GREEDY)[0].token_ids == expected[-1]
    _assert_idle(llm)


def test_preemption_gives_the_same_outputs(ckpt, prompts):  # noqa: ANN001
    from dsv4.state import bytes_per_seq, bytes_per_token

    # 8 pages beyond the fixed per-slot state: 8 prompts needing up to 3 pages each must preempt
    per_page = int(bytes_per_token(ARGS, torch.float32) * 16)
    budget = 8 * bytes_per_seq(ARGS, torch.float32) + 8 * per_page
    llm = LLM(
        ckpt,
        progress=False,
        max_seqs=8,
        max_step_tokens=64,
        chunk_size=64,
        max_memory=budget,
        block_size=16,
    )
    assert llm.state.num_blocks == 8
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # decodes cross pages
    outs = llm.generate(prompts, long)
    assert llm.engine.scheduler.num_preemptions > 0
    hf = hf_model(ckpt)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 20) for p in prompts]
    _assert_idle(llm)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_frees_everything(ckpt, prompts, when):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, max_seqs=4, chunk_size=8, block_size=16)
    rid = llm.add_request(prompts[-1], GREEDY)
    other = llm.add_request(prompts[2], GREEDY)
    llm.engine.step()
    req = llm.engine.requests[rid]
    if when == "decode":
        while req.num_computed < req.num_tokens - 1 or not req.output_ids:
            llm.engine.step()
    else:
        assert req.num_computed < len(req.prompt_ids)  # still prefilling
    llm.engine.abort(rid)
    while llm.engine.has_work():
        llm.engine.step()
    assert other not in llm.engine.requests
    _assert_idle(llm)


def test_seed_reproducible_across_batches(ckpt, prompts):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, max_seqs=8, block_size=16)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompts[3]], sp)[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate([prompts[0], prompts[3], prompts[5]], [noisy, sp, noisy])[1].token_ids
    assert alone == mixed


def test_async_stream_and_cancel(ckpt, prompts):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, max_seqs=4, block_size=16)
    eng = AsyncEngine(llm.engine)

    async def main() -> tuple[list, list]:
        steps = [o async for o in eng.generate(prompts[4], GREEDY)]
        gen = eng.generate(prompts[5], SamplingParams(max_tokens=50, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()  # client went away: the request is aborted and its state freed
        return steps, [first]

    try:
        steps, _ = asyncio.run(main())
    finally:
        eng.shutdown()
    assert [t for s in steps for t in s.delta_token_ids] == steps[-1].token_ids
    assert len(steps) == GREEDY.max_tokens and steps[-1].finished
    _assert_idle(llm)


def test_bad_requests(ckpt):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, max_seq_len=64, block_size=16)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        llm.generate([[2] * 64], GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate([[2], [3]], [GREEDY])


def test_stop_string_and_logprobs_through_engine(ckpt, prompts):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, block_size=16)
    free = llm.generate([prompts[4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    text = free[0].text
    assert len(text) >= 4
    stop = text[2:4]  # spans whatever tokens produced those characters
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], logprobs=2)
    out = llm.generate([prompts[4]], sp)[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert len(out.logprobs) == len(out.token_ids) and len(out.logprobs[0]["top"]) == 2
    assert out.logprobs[0]["logprob"] <= 0.0


def test_chat_cli(ckpt, monkeypatch, capsys):  # noqa: ANN001
    from dsv4.cli import main

    lines = iter(["hi there", ""])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert main(["chat", "--model", str(ckpt), "--max-tokens", "3"]) == 0
    assert "assistant>" in capsys.readouterr().out


def test_prompt_logprobs_equal_teacher_forcing(tmp_path):  # noqa: ANN001
    # SamplingParams.prompt_logprobs: each prompt token's logprob given the ones before it, over
    # chunked prefill and a batch, equals the teacher-forced logits of LLM.score
    from dsv4 import LLM, SamplingParams
    from dsv4.tiny import make_tiny, tiny_args

    llm = LLM(make_tiny(tmp_path / "m", tiny_args(vocab_size=300)), device="cpu",
              progress=False, chunk_size=5)  # fmt: skip
    prompts = [list(range(3, 20)), [7, 8], [9]]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, sp)
    for p, o in zip(prompts, outs):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        if len(p) == 1:
            continue
        want = llm.score(p).log_softmax(-1)
        for i, e in enumerate(o.prompt_logprobs[1:]):
            assert e["token_id"] == p[i + 1]
            assert e["logprob"] == pytest.approx(float(want[i, p[i + 1]]), abs=1e-4)
            assert e["rank"] == int((want[i] > want[i, p[i + 1]]).sum()) + 1
            top = want[i].topk(3)
            assert [t for t, _ in e["top"]] == top.indices.tolist()
    assert llm.generate(prompts[0], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
