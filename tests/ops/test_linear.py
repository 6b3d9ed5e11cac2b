"""FP8 linear / grouped_linear (Triton) against dsv4.ops.ref: the same products, summed in fp32."""

from __future__ import annotations

import pytest
import torch

from dsv4 import quant
from dsv4.ops import linear, ref

# relative-norm tolerance per x dtype: fp32 differs only by summation order; bf16 by the
# reference's bf16 GEMM output rounding
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _fp8(out: int, inp: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    # rows of 128-blocks spanning a few binades: the e8m0 scales differ per (row block, k block)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    rb, kb = -(-out // 128), -(-inp // 128)
    mag = 2.0 ** torch.randint(-3, 4, (rb, kb), generator=g).float()
    w = w * mag.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    wq, s = quant.quant_fp8(w)
    return wq.to(device), s.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lead,N,K",
    [
        ((1,), 64, 256),  # one token, few output tiles: the split-K path
        ((3,), 200, 384),  # rows and K not multiples of the tiles (masks, partial scale block)
        ((2, 5), 128, 300),  # leading dims kept; K % 128 != 0
        ((17,), 48, 128),  # two row tiles
    ],
)
def test_fp8_linear_matches_reference(lead, N, K, dtype) -> None:  # noqa: ANN001
    wq, s = _fp8(N, K)
    x = torch.randn(*lead, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = linear.linear(x, wq, "fp8", s)
    want = ref.linear(x, wq, "fp8", s)
    assert y.shape == want.shape and y.dtype == x.dtype
    assert _rel(y, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,G,R,K", [(1, 2, 128, 256), (5, 4, 128, 128), (3, 4, 16, 64), (2, 3, 80, 200)]
)  # groups of 16 / 80 rows share scale blocks (the tiny model's wo_a)
def test_grouped_linear_matches_reference(T, G, R, K, dtype) -> None:  # noqa: ANN001
    wq, s = _fp8(G * R, K, seed=2)
    x = torch.randn(T, G, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = linear.grouped_linear(x, wq, "fp8", s)
    want = ref.grouped_linear(x, wq, "fp8", s)
    assert y.shape == (T, G, R) and y.dtype == x.dtype
    assert _rel(y, want) < TOL[dtype]


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize(
    "M,G,R,K,tiles",
    [
        (1, 1, 200, 384, None),
        (3, 2, 48, 300, (16, 2)),
        (4, 1, 64, 1024, (32, 8)),
        (2, 1, 130, 256, None),
        (1, 1, 200, 384, (16, 1, 2)),  # GEMV steps of two scale blocks, the last one half full
        (2, 2, 64, 1100, (32, 2, 4)),  # four blocks a step, two splits, a partial block
    ],
)
def test_gemv_and_dot_forms_match_the_reference(M, G, R, K, tiles, gemv) -> None:  # noqa: ANN001
    # both forms at the same shapes: ragged rows and K, groups, K splits
    wq, s = _fp8(G * R, K, seed=7)
    x = torch.randn(M, G, K, generator=torch.Generator().manual_seed(8))
    y = linear._grouped(x, wq, s, tiles, gemv)
    want = ref.grouped_linear(x, wq, "fp8", s)
    assert y.shape == (M, G, R)
    assert _rel(y, want) < TOL[torch.float32]


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize(
    "M,G,R,K,tiles",
    [(1, 1, 200, 384, None), (3, 2, 48, 300, (16, 2)), (1, 1, 64, 1100, (16, 4, 2))],
)
def test_unscaled_weights_match_the_reference(M, G, R, K, tiles, gemv) -> None:  # noqa: ANN001
    # weights in x's dtype (scale None: the compressors' bf16 projections on a GPU) through both
    # forms, ragged shapes and K splits
    g = torch.Generator().manual_seed(9)
    w = torch.randn(G * R, K, generator=g)
    x = torch.randn(M, G, K, generator=g)
    y = linear._grouped(x, w, None, tiles, gemv)
    want = ref.grouped_linear(x, w, "dense")
    assert y.shape == (M, G, R)
    assert _rel(y, want) < TOL[torch.float32]
    with pytest.raises(AssertionError, match="weight must be torch.float32"):
        linear._grouped(x, w.bfloat16(), None, tiles, gemv)


def test_gemv_form_is_the_default_for_one_row(monkeypatch) -> None:  # noqa: ANN001
    seen = []
    kernel = linear._fp8_linear_kernel
    monkeypatch.setattr(linear, "_fp8_linear_kernel", _Spy(kernel, seen))
    wq, s = _fp8(64, 128)
    for rows in (1, linear.GEMV_MAX_ROWS, linear.GEMV_MAX_ROWS + 1):
        linear.linear(torch.randn(rows, 128), wq, "fp8", s)
    assert seen == [True, True, False]


class _Spy:
    # records the GEMV flag of each launch, then launches
    def __init__(self, kernel, seen: list) -> None:  # noqa: ANN001
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.seen.append(kwargs["GEMV"])
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_wrong_scale_or_dtype_is_named() -> None:
    wq, s = _fp8(128, 256)
    x = torch.randn(1, 256)
    with pytest.raises(AssertionError, match="fp8 scale must be float8_e8m0fnu"):
        linear.linear(x, wq, "fp8", s[:, :1])
    with pytest.raises(AssertionError, match="fp8 weight must be float8_e4m3fn"):
        linear.linear(x, wq.view(torch.uint8), "fp8", s)


def test_large_batches_and_other_formats_take_the_reference(monkeypatch) -> None:  # noqa: ANN001
    calls = []
    monkeypatch.setattr(
        linear, "_grouped", lambda x, *a: calls.append(a) or x[:, 0, :1].expand(-1, 64)
    )
    wq, s = _fp8(64, 128)
    linear.linear(torch.randn(linear.MAX_ROWS + 1, 128), wq, "fp8", s)
    linear.linear(torch.randn(2, 128), torch.randn(64, 128), "dense")  # the CPU: dense stays
    assert calls == []
    linear.linear(torch.randn(linear.MAX_ROWS, 128), wq, "fp8", s)  # up to MAX_ROWS: the kernel
    assert len(calls) == 1
    w = torch.randn(64, 128).bfloat16()  # bf16 weights: up to DENSE_MAX_ROWS only (cuBLAS above)
    x = torch.randn(linear.DENSE_MAX_ROWS + 1, 128).bfloat16()
    assert not linear._kernel_serves(x[:, None], w, "dense")


def test_rows_past_one_tile() -> None:
    # 70 rows: two 64-row tiles of the tensor-core form (its launches take any row count)
    wq, s = _fp8(32, 128, seed=8)
    x = torch.randn(70, 1, 128, generator=torch.Generator().manual_seed(8))
    y = linear._grouped(x, wq, s, gemv=False)
    assert _rel(y[:, 0], ref.linear(x[:, 0], wq, "fp8", s)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_is_the_reference_bits(dtype) -> None:  # noqa: ANN001
    # partial scale blocks on both axes, scales from 2^-27 to 2^73, every e4m3 code (NaN cleared)
    wq, s = _fp8(200, 300, seed=6)
    b = torch.arange(200 * 300) % 256
    wq = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b).to(torch.uint8).view(200, 300)
    wq = wq.view(torch.float8_e4m3fn)
    s = torch.tensor([[100, 127, 200], [110, 150, 120]], dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )
    got = linear.dequant(wq, s, dtype)
    want = quant.dequant_fp8(wq, s, dtype)
    assert got.dtype == dtype and torch.equal(
        got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    with pytest.raises(AssertionError, match="fp8 scale must be float8_e8m0fnu"):
        linear.dequant(wq, s[:, :2], dtype)


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_k_fixup(splits: int) -> None:
    # the last split of each output tile sums the partials: every tile written, the same bits on
    # every call, the arrival counts back at 0 (a stale count would let a later launch finish early)
    wq, s = _fp8(96, 1024, seed=4)  # 3 output tiles of 32 rows, grouped: 2 groups of 48 rows
    x = torch.randn(3, 2, 1024, generator=torch.Generator().manual_seed(5))
    want = ref.grouped_linear(x, wq, "fp8", s)
    first = linear._grouped(x, wq, s, (32, splits))
    assert _rel(first, want) < TOL[torch.float32]
    again = linear._grouped(x, wq, s, (32, splits))
    assert torch.equal(first, again)
    assert int(linear._tile_counters(x.device).abs().sum()) == 0


@pytest.mark.gpu
def test_split_k_fixup_on_gpu_repeated() -> None:
    # many launches back to back (one stream, as in a decode step) with a split every time
    wq, s = _fp8(1024, 4096, device="cuda", seed=6)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    first = linear.linear(x, wq, "fp8", s)
    outs = [linear.linear(x, wq, "fp8", s) for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs)
    assert int(linear._tile_counters(x.device).abs().sum()) == 0
    assert _rel(first, ref.linear(x.float(), wq, "fp8", s)) < 5e-3


# ---- GPU, Flash shapes: wq_a, wq_b, wkv, wo_b and the grouped wo_a at decode batch sizes


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 16, 64, 130, 320, 1100])
@pytest.mark.parametrize(
    "N,K,G", [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (4096, 8192, 1), (8192, 4096, 8)]
)
def test_fp8_linear_on_gpu(T, N, K, G) -> None:  # noqa: ANN001
    wq, s = _fp8(N, K, device="cuda")
    x = torch.randn(T, G, K, device="cuda").to(torch.bfloat16)
    if G == 1:
        y, want = linear.linear(x[:, 0], wq, "fp8", s), ref.linear(x[:, 0], wq, "fp8", s)
    else:
        y = linear.grouped_linear(x, wq, "fp8", s)
        want = ref.grouped_linear(x, wq, "fp8", s)
    # against the fp32 products too: both bf16 results sit within bf16 rounding of it
    exact = ref.linear(x.float().view(-1, K), wq, "fp8", s) if G == 1 else None
    assert _rel(y, want) < 1e-2
    if exact is not None:
        assert _rel(y, exact) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16, 64])
@pytest.mark.parametrize("N,K", [(1024, 4096), (256, 4096), (64, 4096)])
def test_dense_bf16_on_gpu(T, N, K) -> None:  # noqa: ANN001
    # the compressors' wkv | wgate (CSA, HCA; the indexer's) and the indexer's weights_proj: the
    # kernel, not cuBLAS, and against the fp32 products
    g = torch.Generator(device="cuda").manual_seed(T)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    assert linear._kernel_serves(x[:, None], w, "dense")
    y = linear.linear(x, w, "dense")
    assert _rel(y, x.float() @ w.float().T) < 5e-3
    assert _rel(y, ref.linear(x, w, "dense")) < 1e-2
    head = torch.empty(linear.DENSE_MAX_BYTES // 2 + K, K // K, device="cuda").bfloat16()
    assert not linear._kernel_serves(x[:, None, :1], head, "dense")  # the LM head stays on cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,G", [(32768, 1024, 1), (8192, 4096, 8)])
def test_dequant_past_the_kernels_rows_on_gpu(N, K, G) -> None:  # noqa: ANN001
    # past every kernel's rows (a prefill chunk): the weight dequantized in one pass, the
    # reference's bits, then the reference's cuBLAS call: the reference's outputs exactly
    from dsv4.ops import linear_sm90

    wq, s = _fp8(N, K, device="cuda", seed=9)
    assert torch.equal(
        linear.dequant(wq, s, torch.bfloat16), quant.dequant_fp8(wq, s, torch.bfloat16)
    )
    T = max(linear.MAX_ROWS, linear_sm90.MAX_ROWS) + 5
    x = torch.randn(T, G, K, device="cuda").to(torch.bfloat16)
    if G == 1:
        assert torch.equal(linear.linear(x[:, 0], wq, "fp8", s), ref.linear(x[:, 0], wq, "fp8", s))
    else:
        assert torch.equal(
            linear.grouped_linear(x, wq, "fp8", s), ref.grouped_linear(x, wq, "fp8", s)
        )
