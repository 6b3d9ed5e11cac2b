"""MTP speculative decoding: drafts verified in the next step's pass, exact against plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.config import ConfigError, speculative_tokens
from dsv4.engine import Engine
from dsv4.sampling import Sampler
from dsv4.state import Batch
from dsv4.tiny import make_tiny, tiny_args

PROMPTS = [[0, 5, 6, 7, 8, 9, 10], [0, 11, 12], list(range(20, 45))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# chunked prefill (the MTP layer runs over every chunk) and two sequences' worth of pages
KW = dict(device="cpu", progress=False, max_seqs=3, chunk_size=8)


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return LLM(model_dir, **KW)


def _oracle(llm: LLM, want: dict[tuple, list[int]], wrong_at: int | None = None) -> list:
    """Replace the MTP drafts with the plain run's next tokens (token `wrong_at` of each draft
    made wrong), after the MTP layer ran: the accept path, with the MTP state still kept.
    Returns the list of (tokens emitted so far, draft) pairs it proposed."""
    engine, made = llm.engine, []
    real = Engine._draft

    def draft(work, h) -> None:  # noqa: ANN001
        real(engine, work, h)
        for w in work:
            r = w.request
            if r.draft:
                d = list(
                    want[tuple(r.prompt_ids)][len(r.output_ids) : len(r.output_ids) + len(r.draft)]
                )
                if wrong_at is not None and wrong_at < len(d):
                    d[wrong_at] = (d[wrong_at] + 1) % llm.args.vocab_size
                r.draft = d
                made.append((len(r.output_ids), d))

    engine._draft = draft
    return made


@pytest.mark.parametrize(("k", "budget"), [(1, 2048), (2, 2048), (3, 5)])
def test_greedy_equals_plain_decoding(model_dir: Path, plain: LLM, k: int, budget: int) -> None:
    # random MTP weights: nearly every draft is rejected, so each step rewrites the rejected
    # position's window, compressor and entry rows; the tokens must not change. (A step budget
    # of 5 tokens: drafts cut to what fits)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = LLM(model_dir, speculative_config=spec(k), max_step_tokens=budget, **KW)
    assert llm.engine.num_speculative_tokens == k
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    st = llm.engine.stats()
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens <= st.num_draft_tokens


@pytest.mark.parametrize(("k", "wrong_at"), [(1, None), (3, None), (3, 1), (2, 0)])
def test_accepted_drafts_equal_plain_decoding(
    model_dir: Path, plain: LLM, k: int, wrong_at
) -> None:  # noqa: ANN001
    # drafts that are (partly) right: accepted tokens skip steps, the state after them is kept
    # and the next step goes on from there
    outs = plain.generate(PROMPTS, GREEDY)
    want = {tuple(o.prompt_token_ids): o.token_ids for o in outs}
    llm = LLM(model_dir, speculative_config=spec(k), **KW)
    made = _oracle(llm, want, wrong_at)
    steps = 0
    for p in PROMPTS:
        llm.add_request(p, GREEDY)
    got = {}
    while llm.engine.has_work():
        steps += 1
        for o in llm.engine.step():
            if o.finished:
                got[tuple(o.prompt_token_ids)] = o.token_ids
    assert got == want and made
    st = llm.engine.stats()
    accepted_each = k if wrong_at is None else wrong_at
    assert st.num_accepted_tokens >= accepted_each * (len(made) - len(PROMPTS) * k)
    # per position (vLLM's per-position acceptance): in order, none at or past a wrong draft
    per_pos = st.num_accepted_per_pos
    assert len(per_pos) == k and sum(per_pos) == st.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    if wrong_at is not None:
        assert not any(per_pos[wrong_at:])
    plain_steps = 12 + -(-len(PROMPTS[2]) // 8)  # decode steps of the longest + its prefill
    if accepted_each:
        assert steps < plain_steps
    else:
        assert st.num_accepted_tokens == 0


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_are_the_mtp_layers_prediction(model_dir: Path, k: int) -> None:
    # each first draft equals the MTP layer's argmax over the whole sequence in one pass: the MTP
    # window ring holds every kept position, whatever was rejected or chained in between
    llm = LLM(model_dir, speculative_config=spec(k), **KW)
    seen = []
    real = Engine._draft

    def draft(work, h) -> None:  # noqa: ANN001
        real(llm.engine, work, h)
        seen.extend((list(w.request.all_ids), w.request.draft[0]) for w in work if w.request.draft)

    llm.engine._draft = draft
    llm.generate(PROMPTS, GREEDY)
    assert len(seen) > 20
    m, state = llm.model, llm.score_state()
    for ids, d in seen[::4]:
        b = Batch.build([0], [0], [len(ids) - 1], state)
        with torch.inference_mode():
            h = m(torch.tensor(ids[:-1]), b, state)
            logits = m.mtp_logits(m.mtp_forward(h, torch.tensor(ids[1:]), b, state))[-1]
        # the draft is the argmax (up to fp32 reordering between chunked and whole passes)
        assert logits[d] >= logits.max() - 1e-4, (len(ids), d, int(logits.argmax()))


def test_stop_and_logprobs_inside_accepted_drafts(model_dir: Path, plain: LLM) -> None:
    # a stop token among the accepted drafts ends the output there (the rest is dropped), and
    # each emitted token's logprob is the one plain decoding reports
    base = plain.generate(PROMPTS[0], GREEDY)[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base[5]], logprobs=2)
    outs = plain.generate(PROMPTS, sp)
    want = {tuple(o.prompt_token_ids): o.token_ids for o in outs}
    llm = LLM(model_dir, speculative_config=spec(3), **KW)
    _oracle(llm, {k: v + [1] * 12 for k, v in want.items()})
    got = llm.generate(PROMPTS, sp)
    for g, o in zip(got, outs):
        assert (g.token_ids, g.finish_reason) == (o.token_ids, o.finish_reason)
        assert [e["token_id"] for e in g.logprobs] == o.token_ids
        for e, f in zip(g.logprobs, o.logprobs):
            assert e["logprob"] == pytest.approx(f["logprob"], abs=1e-4)
            assert [t for t, _ in e["top"]] == [t for t, _ in f["top"]]
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == 6


def test_random_sampling_with_drafts_runs(model_dir: Path) -> None:
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=3)
    llm = LLM(model_dir, speculative_config=spec(2), **KW)
    outs = llm.generate(PROMPTS, sp)
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)
    # seeded: the same tokens again
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_verified_draw_is_distributed_as_p(draft: int) -> None:
    # a draft accepted with probability p(draft), else a draw from p without it: every token is
    # drawn with probability p, whatever the draft
    p = torch.tensor([0.5, 0.05, 0.3, 0.15, 0.0])
    n = 40000
    logits = p.clamp(min=1e-30).log().expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * n
    torch.manual_seed(0)
    out = Sampler(eos_token_id=99)(logits, params, [[]] * n, [[]] * n, [None] * n, [draft] * n)
    freq = torch.bincount(out.token_ids, minlength=5).float() / n
    assert torch.allclose(freq, p, atol=0.012), freq
    assert float(out.accepted.float().mean()) == pytest.approx(float(p[draft]), abs=0.012)
    assert bool((out.token_ids[out.accepted] == draft).all())
    assert not bool((out.token_ids[~out.accepted] == draft).any())


def test_greedy_verify_and_rows_without_draft() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = Sampler(eos_token_id=99)(
        logits, [SamplingParams(temperature=0)] * 3, [[]] * 3, [[]] * 3, [None] * 3, [1, 2, -1]
    )
    assert out.token_ids.tolist() == [1, 1, 0] and out.accepted.tolist() == [True, False, False]


def test_speculative_config_errors(tmp_path: Path) -> None:
    assert speculative_tokens(None) == 0
    assert speculative_tokens('{"method": "mtp", "num_speculative_tokens": 2}') == 2
    for bad, msg in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 1}, "method must be 'mtp'"),
        ({"method": "mtp"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 0}, r"\[1, 8\]"),
        ({"method": "mtp", "num_speculative_tokens": 1, "draft": 2}, "unknown keys"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            speculative_tokens(bad)
    no_mtp = make_tiny(tmp_path / "nomtp", tiny_args(vocab_size=300, n_mtp_layers=0))
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(no_mtp, speculative_config=spec(1), **KW)


def test_generate_cli_speculative(model_dir: Path, capsys) -> None:  # noqa: ANN001
    flags = ["generate", "1 2 3", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "6"]
    assert main(flags) == 0
    one = capsys.readouterr().out
    assert (
        main([*flags, "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}']) == 0
    )
    assert capsys.readouterr().out == one


def test_server_streams_and_counts_drafts(model_dir: Path, plain: LLM) -> None:
    # `dsv4 serve --speculative-config`: a step may stream several tokens; /metrics counts the
    # draft and accepted tokens under vLLM's names
    import asyncio
    import json

    from tests.serving import in_process

    out = plain.generate(PROMPTS[0], GREEDY)[0]
    want = out.text
    cfg = json.dumps(spec(2))
    server, ac = in_process(model_dir, max_seqs=4, max_seq_len=256, speculative_config=cfg)
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _oracle(server.llm, {tuple(PROMPTS[0]): out.token_ids})

    async def go() -> tuple:
        async with ac:
            full = await ac.post("/v1/completions", json=body)
            stream = await ac.post("/v1/completions", json={**body, "stream": True})
            return full, stream, await ac.get("/metrics"), await ac.get("/get_server_info")

    try:
        full, stream, metrics, info = asyncio.run(go())
    finally:
        server.shutdown()
    assert full.json()["choices"][0]["text"] == want
    chunks = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in stream.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(chunks) == want and len(chunks) < 12  # accepted drafts: fewer chunks
    got = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.text.splitlines()
        if line.startswith("vllm:spec_decode")
    }
    drafted = got["vllm:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and got["vllm:spec_decode_num_accepted_tokens_total"] == drafted
    # every draft right: a verification yields its 2 drafts and 1 token (SGLang's accept length)
    n = got["vllm:spec_decode_num_drafts_total"]
    assert 0 < n and drafted <= 2 * n
    per_pos = [
        line for line in metrics.text.splitlines() if "accepted_tokens_per_pos_total{" in line
    ]
    first, second = (float(line.rsplit(" ", 1)[1]) for line in per_pos)
    # every first draft right; a verification near max_tokens has fewer drafts
    assert first == n and 0 < second <= n and first + second == drafted
    assert 'position="1"' in per_pos[1]
    info = info.json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(1 + drafted / n)
    assert info["speculative_config"] == cfg and "api_key" not in info


def test_two_ranks_speculative_equal_one(model_dir: Path, plain: LLM) -> None:
    # tensor parallel: rank 0's drafts and verified tokens decide on every rank
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    two = LLM(model_dir, tensor_parallel_size=2, speculative_config=spec(2), **KW)
    try:
        got = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
        drafted = two.engine.stats().num_draft_tokens
    finally:
        two.close()
    assert got == want and drafted > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ops", ["ref", "triton"])
def test_gpu_speculative_equals_plain(model_dir: Path, ops: str) -> None:
    # fp32 on the GPU (Triton: packed weights too): random drafts (rejections) and oracle drafts
    # (acceptances) give plain decoding's tokens; the bf16 defaults (graphs for plain steps) run
    # Triton: the verify steps replay CUDA graphs (3 tokens a sequence)
    kw = dict(KW, device="cuda", dtype="float32", ops=ops, quantized=ops == "triton")
    kw["cuda_graphs"] = ops == "triton"
    plain = LLM(model_dir, **kw)
    outs = plain.generate(PROMPTS, GREEDY)
    want = [o.token_ids for o in outs]
    llm = LLM(model_dir, speculative_config=spec(2), **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    _oracle(llm, {tuple(o.prompt_token_ids): o.token_ids for o in outs}, wrong_at=1)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.stats().num_accepted_tokens > 0
    if ops == "triton":
        g = llm.engine.graphs
        assert {q for _, _, q in g.graphs} == {3} and not g.failed
    fast = LLM(model_dir, speculative_config=spec(2), progress=False, max_seqs=3)
    assert fast.config.cuda_graphs and fast.config.dtype == "bfloat16"
    assert all(len(o.token_ids) == 12 for o in fast.generate(PROMPTS, GREEDY))
    assert fast.engine.graphs.graphs and not fast.engine.graphs.failed


def test_preemption_under_speculative_decoding(model_dir: Path) -> None:
    # a pool too small for every sequence: the newest are preempted (drafts dropped, state
    # recomputed, the MTP layer's included) and the tokens still equal plain decoding's
    from dsv4.state import bytes_per_seq, bytes_per_token, step_row_bytes

    args = LLM(model_dir, **KW).args
    per_page = int(bytes_per_token(args, torch.float32) * 16)
    kw = dict(KW, max_seqs=3, block_size=16, chunk_size=64)
    # the slots' fixed state, the verify steps' compressor rows (3 x 3 tokens), 4 pages
    fixed = 3 * bytes_per_seq(args, torch.float32) + 9 * step_row_bytes(args)
    kw["max_memory"] = fixed + 4 * per_page
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model_dir, **dict(kw, max_memory=kw["max_memory"] - 9 * step_row_bytes(args)))
    want = {tuple(o.prompt_token_ids): o.token_ids for o in plain.generate(PROMPTS, long)}
    llm = LLM(model_dir, speculative_config=spec(2), **kw)
    assert llm.state.num_blocks == plain.state.num_blocks == 4
    _oracle(llm, want, wrong_at=1)  # some drafts accepted: steps of several tokens
    outs = llm.generate(PROMPTS, long)
    assert {tuple(o.prompt_token_ids): o.token_ids for o in outs} == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats().num_accepted_tokens


def test_drafts_stop_at_the_context_limit(model_dir: Path, plain: LLM) -> None:
    # generation up to max_seq_len: drafts (and the MTP passes that make them) never reach past
    # the last position a request may hold; small pages: the drafts cross page boundaries
    kw = dict(KW, max_seq_len=48, block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 60))]
    want = [o.token_ids for o in LLM(model_dir, **kw).generate(prompts, sp)]
    assert [len(t) for t in want] == [48 - 37, 48 - 10]
    for k in (1, 5):
        llm = LLM(model_dir, speculative_config=spec(k), **kw)
        _oracle(llm, {tuple(p): t for p, t in zip(prompts, want)})
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
