"""Static decode steps (what a CUDA graph captures) give the eager step's logits and state."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.bench import step
from dsv4.bench.weights import fill_state_, init_random_
from dsv4.model import Transformer
from dsv4.ops import select
from dsv4.state import Batch, DecodeState


@pytest.fixture(scope="module")
def model_and_state():  # noqa: ANN201
    args, _ = step.bench_args("tiny", step._layer_list("sliding:hash,csa,hca"))
    model = Transformer(args, torch.float32, quantized=True, ops=select("ref"))
    init_random_(model, seed=5)
    state = DecodeState(args, 4, 256, torch.float32, "cpu")
    fill_state_(state, seed=5)
    return model, state


def _state_tensors(state: DecodeState) -> list[torch.Tensor]:
    out = []
    for layer in state.layers:
        out.append(layer.window)
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                out += [c.kv_cache, c.kv_state, c.score_state]
                out += [] if c.kv_scale is None else [c.kv_scale]
    return out


# positions: CSA (ratio 4) windows close at p = 3 mod 4, HCA (ratio 16) at p = 15 mod 16
@pytest.mark.parametrize(
    "slots,starts,graph_len",
    [
        ([0, 2, 1], [47, 100, 130], 256),  # 47: both close; 100: none; 130: none
        ([3], [63], 64),  # both close, the width exactly at the bound
        ([1, 3], [5, 250], 256),  # early CSA window (w = 1), far HCA
    ],
)
def test_static_step_matches_eager(model_and_state, slots, starts, graph_len) -> None:  # noqa: ANN001
    model, state0 = model_and_state
    ids = torch.tensor([7, 11, 13][: len(slots)])
    eager_state, static_state = copy.deepcopy(state0), copy.deepcopy(state0)
    with torch.inference_mode():
        b = Batch.build(slots, starts, [1] * len(slots), eager_state)
        want = model.logits(model(ids, b, eager_state))
        # one padding row, a copy of sequence 0: same inputs, so the same writes
        pad_slots = torch.tensor(slots + [slots[0]])
        pad_starts = torch.tensor(starts + [starts[0]])
        pad_ids = torch.cat([ids, ids[:1]])
        sb = Batch.build_static(pad_slots, pad_starts, static_state, graph_len)
        got = model.logits(model(pad_ids, sb, static_state))
    torch.testing.assert_close(got[: len(slots)], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[-1], want[0], rtol=1e-5, atol=1e-5)
    for a, c in zip(_state_tensors(static_state), _state_tensors(eager_state)):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    changed = sum(
        not torch.equal(a, c) for a, c in zip(_state_tensors(eager_state), _state_tensors(state0))
    )
    assert changed > 0  # the step wrote state (the comparison above is not vacuous)


@pytest.mark.parametrize(
    "slots,starts,q",
    [
        ([0, 2, 1], [45, 100, 126], 3),  # 47: both close (token 2); 127: both close (token 1)
        ([3], [60], 4),  # 63 closes both at the last token
        ([1, 3], [0, 250], 2),  # a sequence's first tokens, and one near the bound
    ],
)
def test_static_verify_step_matches_eager(model_and_state, slots, starts, q) -> None:  # noqa: ANN001
    # speculative decoding's verify step: q tokens per sequence, static like a decode step
    model, state0 = model_and_state
    n = len(slots)
    ids = torch.arange(7, 7 + n * q)
    eager_state, static_state = copy.deepcopy(state0), copy.deepcopy(state0)
    with torch.inference_mode():
        b = Batch.build(slots, starts, [q] * n, eager_state)
        want = model.logits(model(ids, b, eager_state))
        pad = torch.cat([ids, ids[:q]])  # one padding sequence, a copy of sequence 0
        sb = Batch.build_static(
            torch.tensor(slots + slots[:1]), torch.tensor(starts + starts[:1]), static_state, 256, q
        )
        got = model.logits(model(pad, sb, static_state))
    torch.testing.assert_close(got[: n * q], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[n * q :], want[:q], rtol=1e-5, atol=1e-5)
    for a, c in zip(_state_tensors(static_state), _state_tensors(eager_state)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)  # (GEMMs of another row count)
    with pytest.raises(ValueError, match="tokens per sequence"):
        Batch.build_static(torch.tensor([0]), torch.tensor([3]), state0, 256, 9)


def test_static_rejects_a_bad_bound(model_and_state) -> None:  # noqa: ANN001
    _, state = model_and_state
    with pytest.raises(ValueError, match="graph_len"):
        Batch.build_static(torch.tensor([0]), torch.tensor([3]), state, 10_000)


def test_graph_keys() -> None:
    from dsv4.cuda_graphs import graph_key

    assert graph_key(1, 0, 4096) == (1, 256)  # the smallest bound
    assert graph_key(3, 255, 4096) == (4, 256)
    assert graph_key(3, 256, 4096) == (4, 320)  # position 256 needs a bound > 256: 1.25 x 256
    assert graph_key(5, 3000, 4096) == (8, 3072)  # 1.5 x 2048
    assert graph_key(2, 3583, 8192) == (2, 3584)  # 1.75 x 2048
    assert graph_key(2, 3584, 8192) == (2, 4096)
    assert graph_key(64, 5000, 5100) == (64, 5100)  # never past max_seq_len
    # four bounds an octave, each step at most 25% past the last: every position gets the least
    bounds = sorted({graph_key(1, p, 1 << 20)[1] for p in range(255, 1 << 14)})
    assert bounds[:6] == [256, 320, 384, 448, 512, 640] and len(bounds) == 1 + 4 * 6
    for p in range(0, 1 << 14, 7):
        b = graph_key(1, p, 1 << 20)[1]
        assert b == min(x for x in bounds if x > p)


def test_position_bounds() -> None:
    # every bound graph_key gives, smallest first, ending at max_seq_len
    from dsv4.cuda_graphs import graph_key, position_bounds

    assert position_bounds(256) == [256]
    assert position_bounds(300) == [256, 300]
    assert position_bounds(1024) == [256, 320, 384, 448, 512, 640, 768, 896, 1024]
    for n in (1000, 4096, 5100):
        assert position_bounds(n) == sorted({graph_key(1, p, n)[1] for p in range(n)})


def test_cuda_graphs_need_cuda_and_triton(tmp_path) -> None:  # noqa: ANN001
    from dsv4.config import ConfigError
    from dsv4.llm import LLM
    from dsv4.tiny import make_tiny, tiny_args

    tiny = make_tiny(tmp_path / "m", tiny_args(vocab_size=300))
    with pytest.raises(
        ConfigError, match="cuda_graphs needs a CUDA device, ops='triton' and quantized=True"
    ):
        LLM(tiny, cuda_graphs=True, progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_with_cuda_graphs_matches_eager(
    tmp_path,
    kv_cache_dtype: str,
    fused: bool,
    monkeypatch,  # noqa: ANN001
) -> None:
    # greedy decoding of several prompts of different lengths: replayed graphs give the eager
    # engine's tokens; every decode step ran from a graph. fused: the step's lists in one launch
    # (decode_lists.FUSED) and the attention's hc_post with the FFN's hc_pre (mhc.POST_PRE_MAX_T)
    from dsv4.llm import LLM
    from dsv4.ops import decode_lists, mhc
    from dsv4.sampling import SamplingParams
    from dsv4.tiny import make_tiny, tiny_args

    monkeypatch.setattr(decode_lists, "FUSED", fused)
    monkeypatch.setattr(mhc, "POST_PRE_MAX_T", 16 if fused else 0)
    tiny = make_tiny(tmp_path / "m", tiny_args(vocab_size=300))
    prompts = [list(range(2, 2 + n)) for n in (5, 40, 77)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # packed MXFP4 experts in bf16: the Triton MoE (dequantized experts take the torch reference,
    # which counts tokens per expert on the host and cannot be captured)
    kw = dict(device="cuda", ops="triton", dtype="bfloat16", quantized=True, max_seqs=4)
    kw |= dict(max_seq_len=512, progress=False, kv_cache_dtype=kv_cache_dtype)
    eager = LLM(tiny, cuda_graphs=False, **kw).generate(prompts, sp)
    llm = LLM(tiny, cuda_graphs=True, **kw)
    graphed = llm.generate(prompts, sp)
    graphs = llm.engine.graphs
    assert graphs.graphs and not graphs.failed
    for a, b in zip(graphed, eager):
        assert a.token_ids == b.token_ids


@pytest.mark.gpu
def test_graphs_through_a_priority_preemption(tmp_path) -> None:  # noqa: ANN001
    # two slots held by outranked requests; a later one preempts the newer (SGLang's threshold),
    # which recomputes its prompt and output: the graphed engine gives the eager one's tokens
    from dsv4.llm import LLM
    from dsv4.sampling import SamplingParams
    from dsv4.tiny import make_tiny, tiny_args

    tiny = make_tiny(tmp_path / "m", tiny_args(vocab_size=300))
    prompts = [list(range(2, 2 + n)) for n in (5, 40, 77)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", ops="triton", dtype="bfloat16", quantized=True, max_seqs=2)
    kw |= dict(max_seq_len=512, progress=False, scheduling_policy="priority",
               priority_preemption_threshold=10)  # fmt: skip

    def run(graphs: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(tiny, cuda_graphs=graphs, **kw)
        rids = [llm.add_request(p, sp, f"low{i}", priority=50) for i, p in enumerate(prompts[:2])]
        for _ in range(4):
            llm.engine.step()
        rids.append(llm.add_request(prompts[2], sp, "high", priority=0))
        done = {}
        while llm.engine.has_work():
            done |= {o.request_id: o.token_ids for o in llm.engine.step() if o.finished}
        assert llm.engine.scheduler.num_preemptions == 1
        return [done[r] for r in rids], llm

    eager, _ = run(False)
    graphed, llm = run(True)
    assert graphed == eager and all(len(t) == 24 for t in graphed)
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed


@pytest.mark.gpu
def test_graphs_keep_no_logits_each(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # a generation that crosses a position bound captures a second graph of its batch bucket; that
    # capture leaves no allocation of its logits' size behind (they go to DecodeGraphs.out). With
    # four bounds an octave a long generation captures dozens of graphs; until the twenty-first
    # session each kept its logits and a 32 MiB cuBLAS workspace (a new stream per capture)
    from dsv4.cuda_graphs import DecodeGraphs
    from dsv4.llm import LLM
    from dsv4.sampling import SamplingParams
    from dsv4.tiny import make_tiny, tiny_args

    vocab = 65536  # 256 KB of fp32 logits a row
    tiny = make_tiny(tmp_path / "m", tiny_args(vocab_size=vocab))
    grown = []
    capture = DecodeGraphs._capture

    def measured(self, key, *rest):  # noqa: ANN001, ANN002, ANN202
        before = torch.cuda.memory_allocated()
        graph = capture(self, key, *rest)
        grown.append((key, torch.cuda.memory_allocated() - before))
        return graph

    monkeypatch.setattr(DecodeGraphs, "_capture", measured)
    kw = dict(device="cuda", ops="triton", dtype="bfloat16", quantized=True, max_seqs=1)
    llm = LLM(tiny, cuda_graphs=True, max_seq_len=512, progress=False, **kw)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate([list(range(2, 250))], sp)  # decode steps cross position 256: bounds 256, 320
    assert [k for k, _ in grown] == [(1, 256, 1), (1, 320, 1)] and not llm.engine.graphs.failed
    assert grown[1][1] < vocab * 4 // 2, grown


@pytest.mark.gpu
def test_warmed_bounds_compile_nothing_later(tmp_path) -> None:  # noqa: ANN001
    # the warm-up runs every graph's step once at every position bound (Engine.compile_graphs):
    # a generation that later crosses bounds captures their graphs but compiles no kernel.
    # Until the thirty-second session the indexer's tiles and select blocks per context octave
    # compiled inside those captures (docs/PERF.md)
    import logging

    from dsv4.cuda_graphs import position_bounds
    from dsv4.llm import LLM
    from dsv4.ops.device import CompileWatch
    from dsv4.sampling import SamplingParams
    from dsv4.tiny import make_tiny, tiny_args

    tiny = make_tiny(tmp_path / "m", tiny_args(vocab_size=300))
    kw = dict(device="cuda", ops="triton", dtype="bfloat16", quantized=True, max_seqs=2)
    llm = LLM(tiny, cuda_graphs=True, max_seq_len=1024, progress=False, **kw)
    ran = []
    compile_all = llm.engine.graphs.compile_all
    llm.engine.graphs.compile_all = lambda slot: ran.append(compile_all(slot)) or ran[-1]
    llm.warmup()
    assert ran == [len(position_bounds(1024)) * 2]  # buckets 1 and 2
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for first in (2, 3):  # 256 + 400 positions each
        llm.add_request(list(range(first, first + 256)), sp)
    llm.engine.step()  # both prefills (watched from the first decode step on)
    watch = CompileWatch(logging.getLogger("test.graph")).install()
    try:
        while llm.engine.has_work():
            llm.engine.step()
    finally:
        watch.uninstall()
    graphs = llm.engine.graphs
    assert {b for _, b, _ in graphs.graphs} >= {256, 320, 384, 448, 512, 640}
    assert not graphs.failed
    assert watch.count == 0, watch.names
