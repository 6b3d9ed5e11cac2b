"""moe_experts (Triton, MXFP4 experts) against dsv4.ops.ref.moe_experts, plus the routing
alignment and the cached address table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4 import quant
from dsv4.model import Build, Expert
from dsv4.ops import moe, ref, select
from dsv4.tiny import tiny_args

from .ptx import run_ptx

# relative-norm tolerance per x dtype: fp32 differs only by summation order; bf16 follows the
# reference's cast points (exact in the interpreter, a bf16 ulp here and there on the GPU)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _experts(D: int, I: int, E: int, seed: int = 0, device: str = "cpu") -> torch.nn.ModuleList:  # noqa: E741
    # Flash-layout experts (Build / Expert, fmt "fp4") holding quant_mxfp4 of random weights whose
    # rows span a few binades, so the e8m0 scales differ per 32-block
    g = torch.Generator().manual_seed(seed)
    b = Build(tiny_args(dim=D, moe_inter_dim=I), torch.float32, "dense", "fp4", select("ref"))
    experts = torch.nn.ModuleList(Expert(b, I, "fp4") for _ in range(E))
    for ex in experts:
        for lin in (ex.w1, ex.w3, ex.w2):
            out, inp = lin.weight.shape[0], lin.weight.shape[1] * 2
            w = torch.randn(out, inp, generator=g) * 0.2
            w = w * 2.0 ** torch.randint(-2, 3, (out, inp // 32, 1), generator=g).repeat_interleave(
                32, 1
            ).view(out, inp)
            packed, scale = quant.quant_mxfp4(w)
            lin.weight.data.copy_(packed)
            lin.scale.data.copy_(scale)
    return experts.to(device)


def _routing(
    T: int, k: int, E: int, skew: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    # idx: [T, k] distinct experts per token ; skew: most tokens pick experts 0..k-1 (many rows
    # for them, several row-blocks), the rest of the experts are left mostly unused
    g = torch.Generator().manual_seed(seed + 1)
    if skew:
        idx = torch.arange(k).expand(T, k).clone()
        odd = torch.rand(T, generator=g) < 0.3
        idx[odd, 0] = torch.randint(k, E, (int(odd.sum()),), generator=g)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g) + 0.1
    return weights, idx


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _check(x, weights, idx, experts, dtype) -> None:  # noqa: ANN001
    y = moe.moe_experts(x, weights, idx, experts)
    want = ref.moe_experts(x, weights, idx, experts)
    want32 = ref.moe_experts(x.float(), weights, idx, experts)
    assert y.dtype == torch.float32 and y.shape == x.shape, (y.dtype, y.shape)
    err = _rel(y, want)
    assert err < TOL[dtype], f"rel err vs ref {err:.3g} (tol {TOL[dtype]})"
    # and against the fp32 reference: bf16 rounding only
    assert _rel(y, want32) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_sum_slots_and_shared() -> None:
    # the k slots summed in fp32 in slot order, plus the shared expert, in one launch: the same
    # bits as a sequential fp32 sum (and the reference's sum to rounding); T = 0 gives [0, D]
    torch.manual_seed(3)
    T, k, D = 5, 6, 1100
    out = (torch.randn(T * k, D) * 4.0).to(torch.bfloat16)
    shared = (torch.randn(T, D) * 4.0).to(torch.bfloat16)
    seq = out.view(T, k, D).float()
    want = seq[:, 0].clone()
    for j in range(1, k):
        want += seq[:, j]
    assert torch.equal(moe.sum_slots(out, k), want)
    assert torch.equal(moe.sum_slots(out, k, shared), want + shared.float())
    assert _rel(moe.sum_slots(out, k), seq.sum(1)) < 1e-6
    assert moe.sum_slots(out[:0], k).shape == (0, D)
    # returned in bf16 by the same launch: the fp32 sum rounded to nearest even, as torch's cast
    y = moe.sum_slots(out, k, shared, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (want + shared.float()).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_shared(dtype: torch.dtype) -> None:
    # the shared expert's output added in the slot-sum launch: as the reference adds it
    torch.manual_seed(4)
    D, I, E, k, T = 64, 32, 4, 2, 5  # noqa: E741
    experts = _experts(D, I, E)
    weights, idx = _routing(T, k, E, False)
    x = torch.randn(T, D).to(dtype)
    shared = torch.randn(T, D).to(dtype)
    y = moe.moe_experts(x, weights, idx, experts, shared=shared)
    assert torch.equal(y, moe.moe_experts(x, weights, idx, experts) + shared.float())
    want = ref.moe_experts(x, weights, idx, experts, shared)
    assert torch.equal(want, ref.moe_experts(x, weights, idx, experts) + shared.float())
    assert _rel(y, want) < TOL[dtype]
    empty = moe.moe_experts(x[:0], weights[:0], idx[:0], experts, shared=shared[:0])
    assert empty.shape == (0, D)


# (D, I, E, k, T, skew): one token, ragged counts, unused experts, experts with > BLOCK_M rows
SHAPES = [
    (64, 32, 4, 1, 1, False),
    (64, 32, 4, 2, 5, False),
    (96, 64, 9, 3, 17, False),
    (64, 64, 9, 2, 17, True),
    (96, 32, 4, 3, 17, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,I,E,k,T,skew", SHAPES)
def test_moe_experts(D: int, I: int, E: int, k: int, T: int, skew: bool, dtype) -> None:  # noqa: E741, ANN001
    experts = _experts(D, I, E, seed=D + I + E)
    weights, idx = _routing(T, k, E, skew, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(dtype)
    _check(x, weights, idx, experts, dtype)


@pytest.mark.parametrize("D,I,E,k,T,skew", [SHAPES[1], SHAPES[4]])
def test_moe_experts_dot_scaled(D: int, I: int, E: int, k: int, T: int, skew: bool) -> None:  # noqa: E741
    # tl.dot_scaled on the packed codes and e8m0 scales (bf16 x) instead of the kernels' decode:
    # the same cast points, so the same tolerance against the reference
    experts = _experts(D, I, E, seed=D + I + E)
    weights, idx = _routing(T, k, E, skew, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    y = moe.moe_experts(x, weights, idx, experts, dot_scaled=True)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < TOL[torch.bfloat16], _rel(y, want)
    y0 = moe.moe_experts(x, weights, idx, experts, dot_scaled=False)
    assert _rel(y, y0) < TOL[torch.bfloat16], _rel(y, y0)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,I,E,k,T,skew", [SHAPES[0], SHAPES[3], (128, 96, 4, 2, 3, False)])
def test_moe_experts_gemv(
    D: int,
    I: int,  # noqa: E741
    E: int,
    k: int,
    T: int,
    skew: bool,
    dtype,  # noqa: ANN001
    prefetch: bool,
) -> None:
    # one pair per row-block, products summed on the CUDA cores (the GPU's batch-1 path): the same
    # cast points, so the same tolerance against the reference and the dot path; with PREFETCH
    # the next step's loads come first (32-wide steps: 4 and 3 in the last shape, whose last step
    # reloads itself)
    experts = _experts(D, I, E, seed=D + I + E)
    weights, idx = _routing(T, k, E, skew, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(dtype)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1, "PREFETCH": prefetch}
    y = moe.moe_experts(x, weights, idx, experts, config=cfg, gemv=True)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < TOL[dtype], _rel(y, want)
    y0 = moe.moe_experts(x, weights, idx, experts, gemv=False)
    assert _rel(y, y0) < TOL[dtype], _rel(y, y0)


def test_gemv_decode_ptx_is_the_reference_dequantization() -> None:
    # the GEMV form's inline PTX (GPU only) against the packed codes' values: output i of a word
    # is code i (column 8w + i, low nibble first) times 2^-14 in fp32, bit for bit, over random
    # words and every code at every position
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    words[:16] = np.arange(16, dtype=np.uint32) * np.uint32(0x11111111)
    env = run_ptx(moe._E2M1_WORDS_ASM.value, {"$8": words})
    # each word's 4 bytes as one 32-column row (repeated: a whole scale group), scale 2^0
    codes = torch.from_numpy(words.view(np.uint8).copy()).view(torch.int8).view(-1, 4)
    one = torch.full((codes.shape[0], 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = quant.dequant_mxfp4(codes.repeat(1, 4), one).double() * 2.0**-14
    for i in range(8):
        got = torch.from_numpy(env[f"${i}"].view(np.float32).astype(np.float64))
        assert torch.equal(got, want[:, i]), i


@pytest.mark.parametrize("D,I", [(4096, 2048), (96, 64), (64, 32), (7168, 2048)])
@pytest.mark.parametrize("pairs", [6, 12, 48])
def test_gemv_config(D: int, I: int, pairs: int) -> None:  # noqa: E741
    # the GEMV tiles' reduction step divides both widths (the kernels' loops have no tail)
    cfg = moe.gemv_config(pairs, D, I)
    assert cfg["BLOCK_K"] >= 32 and D % cfg["BLOCK_K"] == 0 and I % cfg["BLOCK_K"] == 0, cfg
    one = pairs <= 8  # batch 1 at k=6: the narrow tile under a register cap
    assert cfg["BLOCK_N"] == (8 if one else 16) and cfg["PREFETCH"] == one, cfg
    assert moe.gemv_config(pairs, 4096, 2048)["BLOCK_K"] == (512 if one else 1024)


def test_moe_experts_strided_x_and_limit() -> None:
    # x rows with a padded stride, a limit small enough that both clamps bite
    experts = _experts(64, 32, 4, seed=3)
    for ex in experts:
        ex.limit = 0.5
    weights, idx = _routing(5, 2, 4, False, seed=4)
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(5))[:, :64] * 4
    _check(x, weights, idx, experts, torch.float32)


def test_moe_experts_repeated_expert_in_a_row() -> None:
    # the same expert in two slots of one token: two pairs, both counted
    experts = _experts(64, 32, 4, seed=6)
    idx = torch.tensor([[1, 1], [2, 1], [3, 3]])
    weights = torch.rand(3, 2) + 0.1
    x = torch.randn(3, 64)
    _check(x, weights, idx, experts, torch.float32)


@pytest.mark.parametrize("form", ["triton", "torch"])
@pytest.mark.parametrize(
    "T,k,E,block_m", [(1, 1, 4, 16), (5, 2, 4, 16), (17, 3, 9, 4), (40, 6, 9, 8), (256, 4, 33, 16)]
)
def test_align_rows(T: int, k: int, E: int, block_m: int, form: str, monkeypatch) -> None:  # noqa: ANN001
    if form == "torch":
        monkeypatch.setattr(moe, "ALIGN_MAX_PAIRS", 0)
    _, idx = _routing(T, k, E, skew=T > 20, seed=T)
    rows, blk = moe.align_rows(idx, E, block_m)
    NB = moe.num_row_blocks(T * k, E, block_m)
    assert rows.dtype == torch.int32 and blk.dtype == torch.int32
    assert rows.shape == (NB * block_m,) and blk.shape == (NB,)
    # every pair exactly once; padding is -1
    real = rows[rows >= 0]
    assert sorted(real.tolist()) == list(range(T * k))
    assert bool(((rows >= 0) | (rows == -1)).all())
    flat = idx.flatten()
    counts = torch.bincount(flat, minlength=E)
    n_real = int(((counts + block_m - 1) // block_m).sum())
    # the real blocks come first, grouped by expert in ascending order; the rest are -1 and empty
    assert (blk[:n_real] >= 0).all() and (blk[n_real:] == -1).all()
    assert (rows.view(NB, block_m)[n_real:] == -1).all()
    assert torch.equal(blk[:n_real], blk[:n_real].sort().values)
    assert torch.equal(
        torch.bincount(blk[:n_real].long(), minlength=E), (counts + block_m - 1) // block_m
    )
    # each block's pairs belong to its expert, in pair order, padding at the end of the block
    for b in range(n_real):
        r = rows.view(NB, block_m)[b]
        pairs = r[r >= 0]
        assert len(pairs) > 0 and (flat[pairs.long()] == blk[b]).all()
        assert (r[: len(pairs)] >= 0).all() and torch.equal(pairs, pairs.sort().values)


def test_align_rows_forms_agree(monkeypatch) -> None:  # noqa: ANN001
    # the one-program Triton form and the torch form give the same layout, bit for bit
    _, idx = _routing(96, 6, 24, skew=True, seed=7)
    one = moe.align_rows(idx, 24, 16)
    monkeypatch.setattr(moe, "ALIGN_MAX_PAIRS", 0)
    two = moe.align_rows(idx, 24, 16)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


# ---------------------------------------------------------------------------------------------
# Expert parallelism: `experts` holds a rank's experts, idx -1 names a pair whose expert lives on
# another rank (it contributes nothing here)
# ---------------------------------------------------------------------------------------------


def _remote(idx: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    # idx with about `frac` of its pairs -1, token 0's all of them (a token with no local expert)
    g = torch.Generator().manual_seed(seed + 2)
    idx = torch.where(torch.rand(idx.shape, generator=g) < frac, -1, idx)
    idx[0] = -1
    return idx


@pytest.fixture
def poisoned_empty(monkeypatch) -> None:  # noqa: ANN001
    # torch.empty of x's dtypes filled with NaN: a row the kernels leave unwritten and a launch
    # then reads shows up as NaN (the CPU allocator often hands out zeroed memory)
    empty = torch.empty

    def poisoned(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype in TOL or t.dtype == torch.float16 else t

    monkeypatch.setattr(torch, "empty", poisoned)


def test_ref_remote_pairs_contribute_nothing() -> None:
    # ref with -1 ids = ref with those pairs' weights 0 and ids any local expert: an independent
    # statement of "contributes nothing" (a zero weight zeroes h, so the pair's w2 output is 0;
    # fp32 to rounding: the experts' matmuls see other batch sizes)
    D, I, E, k, T = 64, 32, 5, 3, 9  # noqa: E741
    experts = _experts(D, I, E, seed=21)
    weights, idx = _routing(T, k, E, False, seed=21)
    remote = _remote(idx, 0.4, seed=21)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(21))
    shared = torch.randn(T, D, generator=torch.Generator().manual_seed(22))
    gone = remote < 0
    any_id = torch.randint(0, E, idx.shape, generator=torch.Generator().manual_seed(23))
    for sh in (None, shared):
        y = ref.moe_experts(x, weights, remote, experts, sh)
        want = ref.moe_experts(
            x, weights.masked_fill(gone, 0.0), torch.where(gone, any_id, remote), experts, sh
        )
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # token 0 has no local expert: 0, or the shared expert's output
    assert torch.equal(ref.moe_experts(x, weights, remote, experts)[0], torch.zeros(D))
    assert torch.equal(ref.moe_experts(x, weights, remote, experts, shared)[0], shared[0])
    # every pair remote (and no local expert at all): zeros / shared
    none = torch.full_like(idx, -1)
    assert torch.equal(ref.moe_experts(x, weights, none, experts, shared), shared)
    empty = torch.nn.ModuleList()
    assert torch.equal(ref.moe_experts(x, weights, none, empty), torch.zeros(T, D))


@pytest.mark.parametrize("form", ["triton", "torch"])
@pytest.mark.parametrize("T,k,E,block_m,frac", [(5, 2, 4, 16, 0.5), (17, 3, 9, 4, 0.3),
                                                (40, 6, 9, 8, 0.6), (7, 2, 4, 4, 1.0)])  # fmt: skip
def test_align_rows_remote_pairs(T: int, k: int, E: int, block_m: int, frac: float, form: str,
                                 monkeypatch) -> None:  # noqa: ANN001  # fmt: skip
    # -1 pairs are in no row; every other pair exactly once, grouped by expert, within the static
    # bound num_row_blocks(T * k, ...); both forms give the same layout
    _, idx = _routing(T, k, E, skew=T > 20, seed=T)
    idx = _remote(idx, frac, seed=T)
    one = moe.align_rows(idx, E, block_m)
    monkeypatch.setattr(moe, "ALIGN_MAX_PAIRS", 0)
    two = moe.align_rows(idx, E, block_m)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    rows, blk = one if form == "triton" else two
    NB = moe.num_row_blocks(T * k, E, block_m)
    assert rows.shape == (NB * block_m,) and blk.shape == (NB,)
    flat = idx.flatten()
    local = (flat >= 0).nonzero().flatten()
    assert sorted(rows[rows >= 0].tolist()) == local.tolist()
    assert bool(((rows >= 0) | (rows == -1)).all())
    counts = torch.bincount(flat[local], minlength=E)
    n_real = int(((counts + block_m - 1) // block_m).sum())
    assert (blk[:n_real] >= 0).all() and (blk[n_real:] == -1).all()
    assert (rows.view(NB, block_m)[n_real:] == -1).all()
    assert torch.equal(blk[:n_real], blk[:n_real].sort().values)
    for b in range(n_real):
        r = rows.view(NB, block_m)[b]
        pairs = r[r >= 0]
        assert len(pairs) > 0 and (flat[pairs.long()] == blk[b]).all()


def test_sum_slots_skips_remote_slots() -> None:
    # the rows of -1 slots are never written (NaN here) and never read: the sum of the others
    torch.manual_seed(5)
    T, k, D = 4, 3, 200
    idx = _remote(torch.randint(0, 8, (T, k)), 0.4, seed=5)
    out = torch.randn(T * k, D)
    out[idx.flatten() < 0] = float("nan")
    shared = torch.randn(T, D)
    masked = out.view(T, k, D).masked_fill((idx < 0)[:, :, None], 0.0)
    want = masked[:, 0].clone()
    for j in range(1, k):
        want += masked[:, j]
    assert torch.equal(moe.sum_slots(out, k, idx=idx), want)
    assert torch.equal(moe.sum_slots(out, k, shared, idx=idx), want + shared)
    assert torch.equal(moe.sum_slots(out, k, shared, idx=torch.full_like(idx, -1)), shared)


# each form of the Triton launcher: (dtype, knobs)
EP_FORMS = {
    "dot-fp32": (torch.float32, {}),
    "dot-bf16": (torch.bfloat16, {}),
    "dot_scaled": (torch.bfloat16, {"dot_scaled": True}),
    "gemv": (torch.float32, {"gemv": True, "config": {"BLOCK_N": 64, "BLOCK_K": 32,
                                                       "num_warps": 4, "num_stages": 1}}),
    "align-torch": (torch.bfloat16, {}),
}  # fmt: skip


@pytest.mark.parametrize("form", list(EP_FORMS))
@pytest.mark.usefixtures("poisoned_empty")
def test_moe_experts_remote_pairs(form: str, monkeypatch) -> None:  # noqa: ANN001
    # a rank's output with ~40% of the pairs remote (token 0 all of them), with and without the
    # shared expert: the reference's; every pair remote gives shared (or 0) exactly
    dtype, knobs = EP_FORMS[form]
    if form == "align-torch":
        monkeypatch.setattr(moe, "ALIGN_MAX_PAIRS", 0)
    D, I, E, k, T = 64, 32, 6, 3, 9  # noqa: E741
    experts = _experts(D, I, E, seed=31)
    weights, idx = _routing(T, k, E, False, seed=31)
    idx = _remote(idx, 0.4, seed=31)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(31)).to(dtype)
    shared = torch.randn(T, D, generator=torch.Generator().manual_seed(32)).to(dtype)
    y = moe.moe_experts(x, weights, idx, experts, shared=shared, **knobs)
    want = ref.moe_experts(x, weights, idx, experts, shared)
    assert _rel(y, want) < TOL[dtype], _rel(y, want)
    assert torch.equal(y[0], shared[0].float())  # no local expert: the shared output alone
    none = torch.full_like(idx, -1)
    y = moe.moe_experts(x, weights, none, experts, shared=shared, **knobs)
    assert torch.equal(y, shared.float())
    y = moe.moe_experts(x, weights, none, experts, out_dtype=dtype, **knobs)
    assert y.dtype == dtype and torch.equal(y, torch.zeros(T, D, dtype=dtype))


def test_moe_experts_no_local_experts() -> None:
    # a rank without routed experts (the early exit to the reference): shared, or zeros
    x, shared = torch.randn(3, 64), torch.randn(3, 64)
    weights, idx = torch.rand(3, 2), torch.full((3, 2), -1)
    empty = torch.nn.ModuleList()
    assert torch.equal(moe.moe_experts(x, weights, idx, empty, shared=shared), shared)
    assert torch.equal(moe.moe_experts(x, weights, idx, empty), torch.zeros(3, 64))


def test_table_cached_and_rebuilt() -> None:
    experts = _experts(64, 32, 4, seed=7)
    weights, idx = _routing(5, 2, 4, False)
    x = torch.randn(5, 64)
    moe.moe_experts(x, weights, idx, experts)
    t1 = moe.expert_table(experts)
    moe.moe_experts(x, weights, idx, experts)
    assert moe.expert_table(experts) is t1  # reused, not rebuilt
    assert t1.offs.shape == (6, 4) and t1.unit == 16  # CPU allocations are 64-byte aligned
    w_at = t1.wbase.data_ptr() + t1.unit * t1.offs
    s_at = t1.sbase.data_ptr() + t1.unit * t1.offs
    assert w_at[0, 2] == experts[2].w1.weight.data_ptr()
    assert w_at[1, 1] == experts[1].w3.weight.data_ptr()
    assert s_at[5, 3] == experts[3].w2.scale.data_ptr()
    # new storage (as after .to(device)): the table follows
    for ex in experts:
        for lin in (ex.w1, ex.w3, ex.w2):
            lin.weight.data = lin.weight.data.clone()
            lin.scale.data = lin.scale.data.clone()
    t2 = moe.expert_table(experts)
    assert t2 is not t1 and t2.wbase.data_ptr() == experts[0].w1.weight.data_ptr()
    _check(x, weights, idx, experts, torch.float32)


def test_table_forgotten_after_storages_move() -> None:
    # sleep mode moves every expert's storage in place (resized to 0 and back): the probe sees
    # only the first and the last expert, so a middle one elsewhere keeps a stale table until
    # forget_params drops it
    experts = _experts(64, 32, 4, seed=7)
    t1 = moe.expert_table(experts)
    w = experts[1].w3.weight
    st, held, old, n = w.untyped_storage(), w.clone(), w.data_ptr(), w.untyped_storage().nbytes()
    fillers = []
    while w.data_ptr() == old and len(fillers) < 8:  # (fillers take the freed blocks)
        st.resize_(0)
        fillers.append(torch.empty(n, dtype=torch.uint8))
        st.resize_(n)
    assert w.data_ptr() != old
    w.copy_(held)
    assert moe.expert_table(experts) is t1  # stale: the probe cannot see expert 1
    moe.forget_params()
    t2 = moe.expert_table(experts)
    assert t2 is not t1
    assert t2.wbase.data_ptr() + t2.unit * t2.offs[1, 1] == experts[1].w3.weight.data_ptr()
    weights, idx = _routing(5, 2, 4, False)
    _check(torch.randn(5, 64), weights, idx, experts, torch.float32)


def test_unaligned_storage() -> None:
    # weights and scales at odd byte addresses (views into one buffer): byte offsets (unit 1)
    experts = _experts(64, 32, 4, seed=8)
    tensors = [
        t for ex in experts for lin in (ex.w1, ex.w3, ex.w2) for t in (lin.weight, lin.scale)
    ]
    buf = torch.zeros(sum(t.numel() + 3 for t in tensors), dtype=torch.uint8)
    at = 1
    for t in tensors:
        view = buf[at : at + t.numel()].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
        at += t.numel() + 3
    assert moe.expert_table(experts).unit == 1
    weights, idx = _routing(5, 2, 4, False, seed=9)
    _check(torch.randn(5, 64), weights, idx, experts, torch.float32)


def test_non_fp4_falls_back_to_ref() -> None:
    b = Build(tiny_args(dim=64, moe_inter_dim=32), torch.float32, "dense", "dense", select("ref"))
    experts = torch.nn.ModuleList(Expert(b, 32, "dense") for _ in range(3))
    for p in experts.parameters():
        p.data.normal_(0, 0.1)
    weights, idx = _routing(4, 2, 3, False)
    x = torch.randn(4, 64)
    y = moe.moe_experts(x, weights, idx, experts)
    assert torch.equal(y, ref.moe_experts(x, weights, idx, experts))


def test_bench_cases_quick() -> None:
    from dsv4.bench import cases_moe

    cs = cases_moe.cases("cpu", True)
    assert cs
    assert {c.op for c in cs} == {"moe_experts", "moe_gate"}
    for c in cs:
        got, want = c.run(), c.ref()
        if c.op == "moe_gate":  # (routing weights, expert ids)
            assert torch.equal(got[1], want[1]), c.shape
            got, want = got[0], want[0]
        err = _rel(got, want)
        assert err < 1e-2, f"{c.shape}: rel err {err:.3g}"
        assert c.bytes > 0


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["dot", "dot_scaled", "gemv", "sm90"])
@pytest.mark.parametrize("T", [1, 8, 16, 64])
def test_moe_experts_flash_gpu(T: int, path: str) -> None:
    # Flash sizes D=4096, inter=2048; 32 experts (memory), k=6, bf16, against ref on the GPU
    # (sm90: the Gluon kernels of dsv4.ops.moe_sm90, on an sm_90 GPU)
    from dsv4.bench.cases_moe import random_experts

    if path == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 experts need an sm_90 GPU")

    D, I, E, k = 4096, 2048, 32, 6  # noqa: E741
    experts = random_experts(D, I, E, "cuda", seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(-1)[:, :k]
    weights = torch.rand(T, k, generator=g, device="cuda") / k
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    y = moe.moe_experts(
        x, weights, idx, experts, dot_scaled=path == "dot_scaled", gemv=path == "gemv",
        sm90=path == "sm90",
    )  # fmt: skip
    want = ref.moe_experts(x, weights, idx, experts)
    want32 = ref.moe_experts(x.float(), weights, idx, experts)
    assert y.dtype == torch.float32 and y.shape == (T, D)
    assert _rel(y, want) < 1e-2, _rel(y, want)
    assert _rel(y, want32) < 2e-2, _rel(y, want32)


@pytest.mark.parametrize("K", [32, 64, 96, 2048, 4096])
def test_autotune_configs_divide_the_reduction(K):  # noqa: ANN001
    # the reduction loop has no tail: every config the autotuner may try must have BLOCK_K | K
    # (a BLOCK_K of 128 at inter=32 read past the rows on the GPU)
    from dsv4.ops.moe import _configs, _prune

    kept = _prune(_configs(), {"K": K})
    assert kept and all(K % c.kwargs["BLOCK_K"] == 0 for c in kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu(dtype: torch.dtype, weighted: bool) -> None:
    # the fused activation against the reference: values past the limit on both sides, a ragged
    # last column block, with and without the routing weight
    g_ = torch.Generator().manual_seed(3)
    T, n, limit = 5, 1500, 7.0
    g = (torch.randn(T, n, generator=g_) * 6).to(dtype)
    u = (torch.randn(T, n, generator=g_) * 6).to(dtype)
    w = torch.rand(T, generator=g_) if weighted else None
    got, want = moe.swiglu(g, u, limit, w), ref.swiglu(g, u, limit, w)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 rounding step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
    assert bool((g.float() > limit).any()) and bool((u.float().abs() > limit).any())


@pytest.mark.gpu
def test_swiglu_gpu() -> None:
    g_ = torch.Generator(device="cuda").manual_seed(4)
    g = (torch.randn(64, 2048, device="cuda", generator=g_) * 6).bfloat16()
    u = (torch.randn(64, 2048, device="cuda", generator=g_) * 6).bfloat16()
    w = torch.rand(64, device="cuda", generator=g_)
    for weights in (None, w):
        got, want = moe.swiglu(g, u, 7.0, weights), ref.swiglu(g, u, 7.0, weights)
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
def test_moe_experts_gemv_small_gpu(T: int) -> None:
    # the GEMV form's default on a GPU at widths its tiles do not divide (BLOCK_K halved to 32)
    experts = _experts(96, 64, 9, seed=11, device="cuda")
    weights, idx = _routing(T, 3, 9, False, seed=T)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    x, weights, idx = x.cuda(), weights.cuda(), idx.cuda()
    y = moe.moe_experts(x, weights, idx, experts)
    want = ref.moe_experts(x, weights, idx, experts)
    assert _rel(y, want) < TOL[torch.bfloat16], _rel(y, want)


def _ranks(idx: torch.Tensor, experts: torch.nn.ModuleList, ranks: int):  # noqa: ANN202
    # expert parallelism over `ranks` ranks: each rank's contiguous run of experts and the ids
    # mapped to its local ones, -1 where the expert is another rank's
    n = len(experts) // ranks
    for r in range(ranks):
        mine = (idx >= r * n) & (idx < (r + 1) * n)
        yield torch.nn.ModuleList(experts[r * n : (r + 1) * n]), torch.where(mine, idx - r * n, -1)


# the launcher's forms at T=16, k=6 on a GPU: "default" is sm90 on an sm_90 GPU, else dot_scaled
EP_GPU_KNOBS = {
    "default": {},
    "dot": {"dot_scaled": False, "gemv": False},
    "dot_scaled": {"dot_scaled": True},
    "gemv": {"gemv": True},
    "sm90": {"sm90": True},
}


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("path", list(EP_GPU_KNOBS))
def test_moe_experts_expert_parallel_gpu(path: str) -> None:
    # Flash sizes, 256 experts over 2 ranks of 128, T=16, k=6, bf16 (token 0's experts all on
    # rank 1): each rank's output with its local ids (-1: the other rank's) is the reference's,
    # and the ranks' sum (the all-reduce) is the whole layer's
    from dsv4.bench.cases_moe import random_experts

    if path == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 experts need an sm_90 GPU")
    D, I, E, k, T = 4096, 2048, 256, 6, 16  # noqa: E741
    experts = random_experts(D, I, E, "cuda", seed=9)
    g = torch.Generator(device="cuda").manual_seed(9)
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(-1)[:, :k]
    idx[0] = torch.arange(E - k, E, device="cuda")
    weights = torch.rand(T, k, generator=g, device="cuda") / k
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    shared = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    total = torch.zeros(T, D, device="cuda")
    for r, (local, lidx) in enumerate(_ranks(idx, experts, 2)):
        assert bool((lidx < 0).any()) and bool((lidx >= 0).any())
        sh = shared if r == 0 else None  # the shared expert on one rank, as the model adds it
        y = moe.moe_experts(x, weights, lidx, local, shared=sh, **EP_GPU_KNOBS[path])
        want = ref.moe_experts(x, weights, lidx, local, sh)
        assert y.dtype == torch.float32 and not bool(y.isnan().any())
        assert _rel(y, want) < 1e-2, (r, _rel(y, want))
        if r == 0:  # token 0 has no expert on rank 0
            assert torch.equal(y[0], shared[0].float())
        total += y
    want = ref.moe_experts(x, weights, idx, experts, shared)
    assert _rel(total, want) < 1e-2, _rel(total, want)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_moe_experts_expert_parallel_graph_gpu(T: int) -> None:
    # the default path (T=1: the GEMV form; T=16: sm90 on an sm_90 GPU) captured once in a CUDA
    # graph and replayed with other routings, other pairs remote each time (every one the last)
    from dsv4.bench.cases_moe import random_experts

    D, I, E, k = 4096, 2048, 64, 6  # noqa: E741
    experts = random_experts(D, I, E, "cuda", seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    weights = torch.rand(T, k, generator=g, device="cuda") / k
    routings = [torch.rand(T, E, generator=g, device="cuda").argsort(-1)[:, :k] for _ in range(3)]
    local, lidx = next(_ranks(routings[0], experts, 2))
    y0 = moe.moe_experts(x, weights, lidx, local, out_dtype=torch.bfloat16)  # compiled, tuned
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe.moe_experts(x, weights, lidx, local, out_dtype=torch.bfloat16)
    for i, idx in enumerate([*routings, torch.full_like(routings[0], E - 1)]):
        lidx.copy_(next(_ranks(idx, experts, 2))[1])
        y.fill_(float("nan"))
        graph.replay()
        want = ref.moe_experts(x, weights, lidx, local, out_dtype=torch.bfloat16)
        assert _rel(y, want) < 1e-2, (i, _rel(y, want))
        if i == 0:
            assert torch.equal(y, y0)
        if i == 3:  # every pair remote
            assert torch.equal(y, torch.zeros_like(y))
