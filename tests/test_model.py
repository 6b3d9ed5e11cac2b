"""The model against transformers' DeepseekV4ForCausalLM (fp32), and prefill == chunked == decode."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import CSA, HCA, SLIDING, YarnArgs
from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args
from tests.reference import hf_greedy, hf_logits, hf_model, independent_dequant

# Three tiny configs that together cover every layer type, both MLP types, several layer orders,
# YaRN on and off, FP8/MXFP4/NVFP4/BF16 weights and odd sizes.
CONFIGS = {
    "sch": tiny_args(vocab_size=300),  # sliding, CSA, HCA, CSA; hash layer 0; YaRN; fp8 + mxfp4
    "order": tiny_args(
        vocab_size=280,
        layer_types=(HCA, CSA, SLIDING, HCA, CSA),
        mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe", "moe"),
        hca_ratio=8,
        window_size=16,
        index_topk=3,
        yarn=None,
        expert_dtype="nvfp4",
        n_mtp_layers=0,
    ),
    "odd": tiny_args(
        vocab_size=263,
        dim=72,
        n_heads=6,
        head_dim=40,
        rope_head_dim=8,
        q_lora_rank=24,
        o_groups=3,
        o_lora_rank=20,
        moe_inter_dim=40,
        n_routed_experts=5,
        n_activated_experts=3,
        window_size=5,
        index_n_heads=3,
        index_head_dim=12,
        index_topk=2,
        layer_types=(CSA, SLIDING, HCA, CSA),
        mlp_layer_types=("moe", "hash_moe", "moe", "moe"),
        hca_ratio=6,
        yarn=YarnArgs(factor=8.0, original_seq_len=4096, beta_fast=16, beta_slow=2),
        weight_dtype="fp8",
        expert_dtype="fp8",
    ),
}


def boundary_lengths(args) -> list[int]:  # noqa: ANN001
    m, mh, w = args.csa_ratio, args.hca_ratio, args.window_size
    lens = {1, m - 1, m, m + 1, mh - 1, mh, mh + 1, w - 1, w, w + 1}
    lens.add(
        m * (args.index_topk + 3) + 2
    )  # more visible CSA entries than index_topk: top-k prunes
    lens.add(max(lens) + 2 * mh + 3)
    return sorted(x for x in lens if x >= 1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):  # noqa: ANN001, ANN201
    args = CONFIGS[request.param]
    d = make_tiny(tmp_path_factory.mktemp(request.param), args, seed=7, tokenizer="bytes")
    weights = independent_dequant(d)
    return d, LLM(d, device="cpu", progress=False), hf_model(d, weights), weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_weights_equal_independent_dequant(case):  # noqa: ANN001
    _, llm, _, weights = case
    sd = llm.model.state_dict()
    assert set(sd) == set(weights)
    for name, ref in weights.items():
        got = sd[name]
        assert got.dtype == (torch.int64 if ref.dtype == torch.int64 else torch.float32), name
        assert torch.equal(got, ref), f"{name} differs from the independent dequantization"


def test_logits_match_transformers(case):  # noqa: ANN001
    _, llm, hf, _ = case
    g = torch.Generator().manual_seed(1)
    for T in boundary_lengths(llm.args):
        ids = torch.randint(2, llm.args.vocab_size, (T,), generator=g).tolist()
        err = _rel(llm.score(ids), hf_logits(hf, ids))
        assert err <= 1e-4, f"T={T}: max relative error {err:.2e}"


def test_top_k_prunes_in_long_prompt(case):  # noqa: ANN001
    # the boundary list really exercises the pruning regime: some query sees > index_topk entries
    args = case[1].args
    if CSA in args.layer_types:
        assert (max(boundary_lengths(args)) + 1) // args.csa_ratio > args.index_topk


def test_prefill_equals_chunked_equals_decode(case):  # noqa: ANN001
    _, llm, _, _ = case
    g = torch.Generator().manual_seed(2)
    T = max(boundary_lengths(llm.args))
    ids = torch.randint(2, llm.args.vocab_size, (T,), generator=g).tolist()
    full = llm.score(ids)
    for chunk in (1, 3, llm.args.csa_ratio + 1, llm.args.window_size + 1, llm.args.hca_ratio):
        err = float((llm.score(ids, chunk_size=chunk) - full).abs().max() / full.abs().max())
        assert err <= 1e-5, f"chunk={chunk}: {err:.2e}"


def test_short_steps_equal_chunks(case, monkeypatch):  # noqa: ANN001
    # steps of 2-3 tokens a sequence with step rows (a verify step's compressor path: the decode
    # launches, the step's projections in rows of their own) give the one-chunk logits, windows
    # closing at every token of a step included; the path ran
    from dsv4.model import Compressor
    from dsv4.state import DecodeState

    _, llm, _, _ = case
    g = torch.Generator().manual_seed(4)
    T = max(boundary_lengths(llm.args))
    ids = torch.randint(2, llm.args.vocab_size, (T,), generator=g).tolist()
    full = llm.score(ids)
    c = llm.config
    llm._score_state = DecodeState(llm.args, c.max_seqs, c.max_seq_len, c.torch_dtype, c.device,
                                   step_rows=3)  # fmt: skip
    calls = []
    real = Compressor.short_step
    monkeypatch.setattr(Compressor, "short_step", lambda *a: calls.append(1) or real(*a))
    try:
        for chunk in (2, 3):
            err = float((llm.score(ids, chunk_size=chunk) - full).abs().max() / full.abs().max())
            assert err <= 1e-5, f"chunk={chunk}: {err:.2e}"
        assert calls
    finally:
        llm._score_state = None


def test_entry_tables_in_slices_equal_whole(case, monkeypatch):  # noqa: ANN001
    # a step whose [tokens x visible entries] table exceeds state.ENTRY_TABLE_ELEMENTS (a long
    # chunk at long context) runs its indexer over each sequence's tokens in slices, given the
    # sequence's row list and counts, and maps a CSA layer's picks to their rows directly: the
    # same logits as the whole tables, and the sliced path ran
    from dsv4 import state
    from dsv4.state import Batch

    _, llm, _, _ = case
    if CSA not in llm.args.layer_types:
        pytest.skip("no CSA layer")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, llm.args.vocab_size, (max(boundary_lengths(llm.args)),), generator=g)
    full = llm.score(ids.tolist())
    slices = []
    real = Batch.index_rows

    def index_rows(b, *a):  # noqa: ANN001, ANN002, ANN202
        rows, counts = real(b, *a)
        slices.append((*a[1:], counts is not None, rows.stride(0)))
        return rows, counts

    monkeypatch.setattr(state, "ENTRY_TABLE_ELEMENTS", 2 * state.ENTRY_ALIGN)  # sliced past 2
    monkeypatch.setattr(state, "INDEX_SLICE_ELEMENTS", 3 * state.ENTRY_ALIGN)  # 3 tokens a slice
    monkeypatch.setattr(Batch, "index_rows", index_rows)
    for chunk in (None, 7):
        got = llm.score(ids.tolist(), chunk_size=chunk)
        assert float((got - full).abs().max() / full.abs().max()) <= 1e-5, chunk
    assert any(t1 - t0 == 3 and c and s == 0 for t0, t1, c, s in slices), slices
    assert any(t1 - t0 < 3 for t0, t1, _, _ in slices), slices  # a chunk's last, shorter slice


def test_index_slices_keep_to_one_sequence(monkeypatch) -> None:  # noqa: ANN001
    # a sliced step's indexer slices never span two sequences (each is given its sequence's
    # row list); an unsliced step is one range
    from dsv4 import state
    from dsv4.state import Batch, DecodeState

    args = tiny_args(layer_types=(CSA,), mlp_layer_types=("moe",), n_mtp_layers=0)
    st = DecodeState(args, 3, 256, torch.float32, "cpu")
    b = Batch.build([0, 1, 2], [100, 0, 40], [9, 20, 5], st)
    m = args.csa_ratio
    assert b.index_slices(m) == [(0, 34)]
    monkeypatch.setattr(state, "ENTRY_TABLE_ELEMENTS", 34 * b.entry_width(m) - 1)
    monkeypatch.setattr(state, "INDEX_SLICE_ELEMENTS", 8 * b.entry_width(m))
    assert b.index_slices(m) == [(0, 8), (8, 9), (9, 17), (17, 25), (25, 29), (29, 34)]
    for t0, t1 in b.index_slices(m):
        rows, counts = b.index_rows(m, t0, t1)
        want, count = b.visible_entries(m)
        hidden = torch.arange(rows.shape[1])[None, :] >= counts[:, None]
        assert torch.equal(rows.masked_fill(hidden, -1), want[t0:t1]) and torch.equal(
            counts, count[t0:t1]
        )


def test_ragged_batch_equals_single(case):  # noqa: ANN001
    # sequences of different lengths and phases in one step give their single-sequence logits
    _, llm, _, _ = case
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(2, llm.args.vocab_size, (n,), generator=g).tolist() for n in (23, 5, 17)]
    single = [llm.score(s) for s in seqs]
    cuts = [(9, 14), (1, 4), (16, 1)]  # first chunk, second chunk per sequence
    logits = [[], [], []]
    for step in range(2):
        slots, starts, ids = [2, 0, 1], [], []
        for s, (a, b) in zip(seqs, cuts):
            lo, hi = (0, a) if step == 0 else (a, a + b)
            starts.append(lo)
            ids.append(s[lo:hi])
        h = llm._forward(slots, starts, ids)
        out = llm.model.logits(h).split([len(x) for x in ids])
        for i in range(3):
            logits[i].append(out[i])
    for i in range(3):
        err = float((torch.cat(logits[i]) - single[i]).abs().max() / single[i].abs().max())
        assert err <= 1e-5, f"sequence {i}: {err:.2e}"


def test_quantized_in_memory_matches_dequantized(case):  # noqa: ANN001
    d, llm, _, _ = case
    q = LLM(d, progress=False, quantized=True)
    kinds = {p.dtype for p in q.model.state_dict().values()}
    assert kinds & {torch.float8_e4m3fn, torch.int8, torch.uint8}, kinds
    ids = list(range(2, 40))
    assert torch.equal(q.score(ids), llm.score(ids))


def test_greedy_generate_matches_transformers(case):  # noqa: ANN001
    _, llm, hf, _ = case
    g = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(2, llm.args.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 20)
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 6)


@pytest.mark.parametrize("name", ["sch", "odd"])
def test_triton_ops_match_reference(name, tmp_path):  # noqa: ANN001
    # the whole model with every Triton kernel (interpreter on CPU) against the torch reference ops,
    # prefill and chunked decode, fp32 activations; "sch" has every layer type and the top-k
    # pruning regime, "odd" non-power-of-2 head and rope dims. ("order" adds nothing kernel-wise
    # and the interpreter is slow.) Four Sinkhorn iterations, not 20: the same kernels (the count
    # is a runtime loop bound; tests/ops/test_mhc.py runs 20), a fifth of the interpreter's
    # hc_pre time, which was most of this test's
    args = CONFIGS[name].replace(hc_sinkhorn_iters=4)
    d = make_tiny(tmp_path, args, seed=7, tokenizer="bytes")
    llm, tri = LLM(d, progress=False), LLM(d, progress=False, ops="triton")
    g = torch.Generator().manual_seed(5)
    T = max(boundary_lengths(llm.args))
    ids = torch.randint(2, llm.args.vocab_size, (T,), generator=g).tolist()
    full = llm.score(ids)
    for chunk in (None, 2 * llm.args.csa_ratio + 1):
        err = _rel(tri.score(ids, chunk_size=chunk), full)
        assert err <= 1e-4, f"chunk={chunk}: {err:.2e}"
    # ragged decode batches through the engine: same greedy tokens as the reference ops
    prompts = [torch.randint(2, llm.args.vocab_size, (n,), generator=g).tolist() for n in (3, 11)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in tri.generate(prompts, sp)] == [
        o.token_ids for o in llm.generate(prompts, sp)
    ]


def test_joined_projections_run_as_one_gemm() -> None:
    # once the weights are final, attention's wq_a / wkv, each compressor's wkv / wgate and the
    # shared expert's w1 / w3 lie in one allocation and `pair` runs them as one GEMM (its outputs are slices of one
    # result) giving what the two projections give apart; a pair split again (a module moved,
    # a tensor replaced) falls back to two calls
    from dsv4.bench.step import _layer_list, bench_args
    from dsv4.bench.weights import init_random_
    from dsv4.model import Attention, Compressor, MoE, Transformer, pair
    from dsv4.ops import select

    args, _ = bench_args("tiny", _layer_list("csa,hca"))
    # FP8 pairs join on whole 128-row scale blocks
    args = args.replace(moe_inter_dim=128, q_lora_rank=128)
    model = Transformer(args, torch.float32, quantized=True, ops=select("ref")).eval()
    init_random_(model, 0)
    pairs = [(m.wkv, m.wgate) for m in model.modules() if isinstance(m, Compressor)]
    pairs += [
        (m.shared_experts.w1, m.shared_experts.w3) for m in model.modules() if isinstance(m, MoE)
    ]
    pairs += [(m.wq_a, m.wkv) for m in model.modules() if isinstance(m, Attention)]
    # CSA: main + indexer compressors, HCA: main; two shared experts; two attentions
    assert len(pairs) == 3 + 2 + 2 + 2 * args.n_mtp_layers, len(pairs)
    x = torch.randn(5, args.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for a, b in pairs:
            ya, yb = pair(x, a, b)
            assert ya.untyped_storage().data_ptr() == yb.untyped_storage().data_ptr(), a.fmt
            torch.testing.assert_close(ya, a(x), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(yb, b(x), rtol=1e-6, atol=1e-6)
            b.weight.data = b.weight.data.clone()  # split again
            ya2, yb2 = pair(x, a, b)
            assert ya2.untyped_storage().data_ptr() != yb2.untyped_storage().data_ptr()
            torch.testing.assert_close(yb2, yb, rtol=1e-6, atol=1e-6)
    fmts = {a.fmt for a, _ in pairs}
    assert fmts == {"dense", "fp8"}, fmts  # both joinable formats were exercised
    # an FP8 pair whose first part ends inside a scale block stays apart (and still runs)
    from dsv4.model import Linear, join_linears

    a, b = (Linear(args.dim, 96, "fp8", torch.float32, select("ref")) for _ in range(2))
    for lin in (a, b):
        lin.weight.data = torch.randn(96, args.dim).to(torch.float8_e4m3fn)
        lin.scale.data = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    join_linears(a, b)
    ya, yb = pair(x, a, b)
    assert ya.untyped_storage().data_ptr() != yb.untyped_storage().data_ptr()
    torch.testing.assert_close(yb, b(x))
