"""Piecewise steps (`dsv4.piecewise`): the pieces over padded static buffers, with the eager
parts between them, give the model's forward (streams and state writes). On the CPU the pieces
run eagerly (capture=False); the GPU test replays them as CUDA graphs."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4 import parallel, piecewise
from dsv4.bench import step
from dsv4.bench.weights import fill_state_, init_random_
from dsv4.model import Transformer
from dsv4.ops import select
from dsv4.state import Batch, DecodeState
from tests.test_graph import _state_tensors


def _model_and_state(device: str, ops: str, dtype: torch.dtype, layers: str, kv: str = "auto"):  # noqa: ANN202
    args, _ = step.bench_args("tiny", step._layer_list(layers))
    with torch.device(device):
        model = Transformer(args, dtype, quantized=True, ops=select(ops))
    init_random_(model, seed=5)
    state = DecodeState(args, 4, 256, dtype, device, kv_format=kv)
    fill_state_(state, seed=5)
    return model, state


@pytest.fixture(scope="module")
def model_and_state():  # noqa: ANN201
    return _model_and_state("cpu", "ref", torch.float32, "sliding:hash,csa,hca")


# (slots, starts, lens): a prefill chunk alone; a chunk with decodes beside it (a mixed step);
# two chunks; a step of exactly one bucket (16 tokens)
STEPS = [
    ([0], [0], [37]),
    ([1, 0, 2], [60, 47, 100], [1, 21, 1]),
    ([3, 1], [0, 40], [9, 13]),
    ([2], [16], [16]),
]


@pytest.mark.parametrize("slots,starts,lens", STEPS)
def test_pieces_match_forward(model_and_state, slots, starts, lens) -> None:  # noqa: ANN001
    model, state0 = model_and_state
    T = sum(lens)
    ids = torch.randint(0, model.args.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    eager_state, piece_state = copy.deepcopy(state0), copy.deepcopy(state0)
    pieces = piecewise.PiecewiseGraphs(model, piece_state, 64, capture=False)
    with torch.inference_mode():
        want = model(ids, Batch.build(slots, starts, lens, eager_state), eager_state)
        # the buffers' pad rows hold another step's values first: rows must not mix
        pieces.buf["o"].normal_()
        pieces.buf["x"].normal_()
        got = pieces.run(ids, Batch.build(slots, starts, lens, piece_state))
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, c in zip(_state_tensors(piece_state), _state_tensors(eager_state)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    changed = sum(
        not torch.equal(a, c) for a, c in zip(_state_tensors(eager_state), _state_tensors(state0))
    )
    assert changed > 0  # the step wrote state (the comparison above is not vacuous)


def test_pieces_fp8_state() -> None:
    # FP8 state entries: a chunk's new K=V rows are quantized inside a piece (uint8 buffer)
    model, state0 = _model_and_state("cpu", "ref", torch.float32, "sliding,csa,hca", kv="fp8")
    assert state0.layers[0].window.dtype == torch.uint8
    slots, starts, lens = [1, 0], [60, 0], [1, 30]
    ids = torch.randint(0, model.args.vocab_size, (31,), generator=torch.Generator().manual_seed(1))
    eager_state, piece_state = copy.deepcopy(state0), copy.deepcopy(state0)
    pieces = piecewise.PiecewiseGraphs(model, piece_state, 64, capture=False)
    with torch.inference_mode():
        want = model(ids, Batch.build(slots, starts, lens, eager_state), eager_state)
        got = pieces.run(ids, Batch.build(slots, starts, lens, piece_state))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, c in zip(_state_tensors(piece_state), _state_tensors(eager_state)):
        assert torch.equal(a, c) if a.dtype == torch.uint8 else torch.allclose(a, c, 1e-5, 1e-5)


def _two_rank_pieces(out, device: str) -> None:  # noqa: ANN001
    # one rank of two (gloo on the CPU, NCCL on GPUs): its half of the heads and experts, the
    # pieces' all-reduces (captured on GPUs)
    par = parallel.from_env()
    dev = parallel.init(par, device)
    gpu = device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    args, _ = step.bench_args("tiny", step._layer_list("sliding,csa,hca"), tp=2)
    with torch.device(dev):
        model = Transformer(args, dtype, quantized=True, ops=select("triton" if gpu else "ref"),
                            par=par)  # fmt: skip
    init_random_(model, seed=5)  # (one seed on every rank: the replicated weights agree)
    state0 = DecodeState(args, 4, 256, dtype, dev)
    fill_state_(state0, seed=5)
    slots, starts, lens = [1, 0, 2], [60, 47, 100], [1, 21, 1]
    ids = torch.randint(0, args.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    ids = ids.to(dev)
    eager_state = copy.deepcopy(state0)
    pieces = piecewise.PiecewiseGraphs(model, copy.deepcopy(state0), 64, capture=gpu)
    tol = dict(rtol=2e-2, atol=2e-2) if gpu else dict(rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        want = model(ids, Batch.build(slots, starts, lens, eager_state), eager_state)
        for _ in range(2 if gpu else 1):  # (GPUs: the capture, then a replay)
            pieces.state = piece_state = copy.deepcopy(state0)
            got = pieces.run(ids, Batch.build(slots, starts, lens, piece_state))
            assert got is not None, "no pieces served the step"
            torch.testing.assert_close(got.float(), want.float(), **tol)
            for a, c in zip(_state_tensors(piece_state), _state_tensors(eager_state)):
                torch.testing.assert_close(a.float(), c.float(), **tol)
    (out / f"rank{par.rank}").write_text("ok")


def test_pieces_two_ranks(tmp_path) -> None:  # noqa: ANN001
    # tensor parallel: each rank's pieces (their all-reduces included) give its forward
    parallel.spawn(2, _two_rank_pieces, tmp_path, "cpu")
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["ok", "ok"]


@pytest.mark.gpu
def test_gpu_pieces_two_ranks(tmp_path) -> None:  # noqa: ANN001
    # two GPUs (scripts/gpu_check.sh tp): the pieces captured with their NCCL all-reduces
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    parallel.spawn(2, _two_rank_pieces, tmp_path, "cuda")
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["ok", "ok"]


def test_pieces_decline(model_and_state) -> None:  # noqa: ANN001
    # a pure decode step (the decode graphs' case) and a step past the largest bucket: None
    model, state0 = model_and_state
    state = copy.deepcopy(state0)
    pieces = piecewise.PiecewiseGraphs(model, state, 32, capture=False)
    assert pieces.max_tokens == 32
    with torch.inference_mode():
        b = Batch.build([0, 1], [10, 20], [1, 1], state)
        assert pieces.run(torch.tensor([3, 4]), b) is None
        b = Batch.build([0], [0], [33], state)
        assert pieces.run(torch.zeros(33, dtype=torch.long), b) is None
    assert piecewise.bucket(1, 2048) == 16 and piecewise.bucket(17, 2048) == 32
    assert piecewise.bucket(2049, 4096) is None and piecewise.bucket(600, 512) is None
    # a budget between buckets: the bucket that holds it
    assert piecewise.PiecewiseGraphs(model, state, 300, capture=False).max_tokens == 384


@pytest.mark.gpu
@pytest.mark.parametrize("slots,starts,lens", STEPS)
def test_gpu_pieces_as_graphs(slots, starts, lens) -> None:  # noqa: ANN001
    # Triton ops, bf16, replayed graphs (twice: the second replay of a bucket reuses its
    # capture) against the eager forward
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, state0 = _model_and_state("cuda", "triton", torch.bfloat16, "sliding:hash,csa,hca")
    T = sum(lens)
    ids = torch.randint(0, model.args.vocab_size, (T,), device="cuda")
    eager_state, piece_state = copy.deepcopy(state0), copy.deepcopy(state0)
    pieces = piecewise.PiecewiseGraphs(model, piece_state, 64)
    with torch.inference_mode():
        want = model(ids, Batch.build(slots, starts, lens, eager_state), eager_state)
        for _ in range(2):
            again = copy.deepcopy(state0)
            pieces.state = again
            got = pieces.run(ids, Batch.build(slots, starts, lens, again))
            assert got is not None
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            for a, c in zip(_state_tensors(again), _state_tensors(eager_state)):
                torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)
    assert piecewise.bucket(T, 64) in pieces.graphs
