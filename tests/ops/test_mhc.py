"""mHC Triton kernels (hc_pre, hc_post, hc_head) against the torch references in dsv4.ops.ref."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import mhc, ref

# relative-norm tolerance of an output, by the dtype it is returned in
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GPU_TOL_FP32 = 1e-4  # fp32 outputs on the GPU: tf32x3 / cuBLAS reduction orders differ, both ~1e-6
EPS = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _params(rows: int, k: int, n_scales: int, device: str = "cpu", seed: int = 0):  # noqa: ANN202
    # realistic magnitudes: mixes ~ N(0, 1) after the RMS norm, scales ~ [0.5, 2], base ~ N(0, 1)
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(rows, k, generator=g) / k**0.5
    scale = 0.5 + 1.5 * torch.rand(n_scales, generator=g)
    base = torch.randn(rows, generator=g)
    return fn.to(device), scale.to(device), base.to(device)


def _x(T: int, n: int, D: int, dtype: torch.dtype, device: str = "cpu", seed: int = 1):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(T, n, D, generator=g)).to(device=device, dtype=dtype)


def _check_pre(out: tuple, x: torch.Tensor, fn, scale, base, iters: int, tol_fp32: float) -> None:  # noqa: ANN001
    y, post, comb = out
    y_ref, post_ref, comb_ref = ref.hc_pre(x.float(), fn, scale, base, EPS, EPS, iters)
    T, n, D = x.shape
    assert y.dtype == x.dtype and y.shape == (T, D)
    assert post.dtype == torch.float32 and post.shape == (T, n)
    assert comb.dtype == torch.float32 and comb.shape == (T, n, n)
    tol_y = TOL[torch.bfloat16] if x.dtype == torch.bfloat16 else tol_fp32
    assert _rel(y, y_ref) < tol_y, f"y: {_rel(y, y_ref):.2e}"
    assert _rel(post, post_ref) < tol_fp32, f"post: {_rel(post, post_ref):.2e}"
    assert _rel(comb, comb_ref) < tol_fp32, f"comb: {_rel(comb, comb_ref):.2e}"


# (T, n, D, sinkhorn_iters): T=1 takes the broadcast path, T>1 tl.dot; D=48 is not a power of 2
PRE_SHAPES = [
    (1, 4, 64, 20),
    (1, 2, 48, 1),
    (3, 2, 32, 3),
    (3, 4, 48, 20),
    (17, 4, 48, 1),
    (17, 2, 64, 20),
    (17, 4, 32, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,D,iters", PRE_SHAPES)
def test_hc_pre(T: int, n: int, D: int, iters: int, dtype: torch.dtype) -> None:
    fn, scale, base = _params((2 + n) * n, n * D, 3)
    x = _x(T, n, D, dtype)
    _check_pre(mhc.hc_pre(x, fn, scale, base, EPS, EPS, iters), x, fn, scale, base, iters, 1e-5)


# forced tiles: many splits with a ragged last one, masked D chunks, 2 token blocks, broadcast at T>1
CONFIGS = [
    mhc._MixConfig(block_t=1, block_k=16, split_k=32, block_d=32, num_warps=4),
    mhc._MixConfig(block_t=16, block_k=16, split_k=48, block_d=16, num_warps=4),
    mhc._MixConfig(block_t=32, block_k=64, split_k=128, block_d=64, num_warps=4),
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"t{c.block_t}k{c.block_k}s{c.split_k}d{c.block_d}"
)
def test_hc_pre_tiles(cfg: mhc._MixConfig) -> None:
    # the broadcast path at T > 1 is cheap to test only at small T (one program per token)
    T, n, D, iters = (3, 4, 48, 20) if cfg.block_t == 1 else (17, 4, 48, 3)
    fn, scale, base = _params((2 + n) * n, n * D, 3, seed=2)
    x = _x(T, n, D, torch.float32, seed=3)
    out = mhc._hc_collapse(x, fn, scale, base, EPS, EPS, iters, True, cfg=cfg)
    _check_pre(out, x, fn, scale, base, iters, 1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_eps_placement(T: int) -> None:
    # large eps values make every place they enter (norm, pre, softmax, Sinkhorn denominators) visible
    n, D, norm_eps, hc_eps = 4, 32, 0.5, 0.1
    fn, scale, base = _params((2 + n) * n, n * D, 3, seed=14)
    x = _x(T, n, D, torch.float32, seed=15)
    y, post, comb = mhc.hc_pre(x, fn, scale, base, norm_eps, hc_eps, 3)
    y_ref, post_ref, comb_ref = ref.hc_pre(x, fn, scale, base, norm_eps, hc_eps, 3)
    for a, b in ((y, y_ref), (post, post_ref), (comb, comb_ref)):
        assert _rel(a, b) < 1e-5, f"{_rel(a, b):.2e}"
    fh, sh, bh = _params(n, n * D, 1, seed=16)
    h = mhc.hc_head(x, fh, sh, bh, norm_eps, hc_eps)
    assert _rel(h, ref.hc_head(x, fh, sh, bh, norm_eps, hc_eps)) < 1e-5


def test_hc_pre_deterministic_and_sinkhorn() -> None:
    n, D = 4, 64
    fn, scale, base = _params((2 + n) * n, n * D, 3, seed=4)
    x = _x(2, n, D, torch.bfloat16, seed=5)
    a = mhc.hc_pre(x, fn, scale, base, EPS, EPS, 20)
    b = mhc.hc_pre(x, fn, scale, base, EPS, EPS, 20)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    comb = a[2]
    # ends on a column normalisation: columns sum to ~1, every entry positive
    torch.testing.assert_close(comb.sum(1), torch.ones(2, n), atol=1e-4, rtol=0)
    assert bool((comb > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,D", [(1, 4, 64), (3, 2, 48), (17, 4, 32)])
def test_hc_head(T: int, n: int, D: int, dtype: torch.dtype) -> None:
    fn, scale, base = _params(n, n * D, 1, seed=6)
    x = _x(T, n, D, dtype, seed=7)
    h = mhc.hc_head(x, fn, scale, base, EPS, EPS)
    h_ref = ref.hc_head(x.float(), fn, scale, base, EPS, EPS)
    assert h.dtype == dtype and h.shape == (T, D)
    assert _rel(h, h_ref) < TOL[dtype], f"{_rel(h, h_ref):.2e}"


def test_hc_head_tiles() -> None:
    T, n, D = 17, 4, 48
    fn, scale, base = _params(n, n * D, 1, seed=8)
    x = _x(T, n, D, torch.float32, seed=9)
    cfg = mhc._MixConfig(block_t=16, block_k=16, split_k=80, block_d=32, num_warps=4)
    h = mhc._hc_collapse(x, fn, scale, base, EPS, EPS, 1, False, cfg=cfg)[0]
    assert _rel(h, ref.hc_head(x, fn, scale, base, EPS, EPS)) < 1e-5


# ---- the collapse through the block's RMSNorm in the finish (norm_weight): one program per token


def _norm_weight(D: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(20)
    return (0.5 + torch.rand(D, generator=g)).to(device)  # not ones: the weight is applied


# (T, n, D, block_d): one column step; several with a ragged last one; the default step
NORM_SHAPES = [(1, 4, 64, None), (3, 4, 48, 16), (17, 2, 300, 128), (2, 4, 40, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,D,block_d", NORM_SHAPES)
def test_hc_pre_norm(T: int, n: int, D: int, block_d: int | None, dtype: torch.dtype) -> None:
    fn, scale, base = _params((2 + n) * n, n * D, 3, seed=21)
    x, w = _x(T, n, D, dtype, seed=22), _norm_weight(D)
    cfg = mhc._MixConfig(1 if T == 1 else 16, 16, 64, block_d, 4) if block_d else None
    y, post, comb = mhc._hc_collapse(x, fn, scale, base, EPS, EPS, 20, True, w, cfg=cfg)
    y_ref, post_ref, comb_ref = ref.hc_pre(x.float(), fn, scale, base, EPS, EPS, 20, w)
    assert y.dtype == dtype and y.shape == (T, D)
    assert _rel(y, y_ref) < TOL[dtype], f"y: {_rel(y, y_ref):.2e}"
    assert _rel(post, post_ref) < 1e-5 and _rel(comb, comb_ref) < 1e-5
    # the reference's rounding points: the collapse in x.dtype, then rms_norm (the reference on
    # x itself; only summation orders differ)
    y_same = ref.hc_pre(x, fn, scale, base, EPS, EPS, 20, w)[0]
    assert _rel(y, y_same) < (1e-6 if dtype == torch.float32 else 1e-3), f"{_rel(y, y_same):.2e}"
    _, post0, comb0 = mhc._hc_collapse(x, fn, scale, base, EPS, EPS, 20, True, cfg=cfg)
    assert torch.equal(post, post0) and torch.equal(comb, comb0)


@pytest.mark.parametrize("T,n,D", [(1, 4, 64), (17, 4, 48)])
def test_hc_head_norm(T: int, n: int, D: int) -> None:
    fn, scale, base = _params(n, n * D, 1, seed=23)
    x, w = _x(T, n, D, torch.bfloat16, seed=24), _norm_weight(D)
    h = mhc.hc_head(x, fn, scale, base, EPS, EPS, w)
    h_ref = ref.hc_head(x.float(), fn, scale, base, EPS, EPS, w)
    assert _rel(h, h_ref) < TOL[torch.bfloat16], f"{_rel(h, h_ref):.2e}"
    h_same = ref.hc_head(x, fn, scale, base, EPS, EPS, w)
    assert _rel(h, h_same) < 1e-3, f"{_rel(h, h_same):.2e}"


# ---- hc_post_pre: the attention sublayer's hc_post also computes the FFN hc_pre's partials


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,D,block_d", [(1, 4, 64, 16), (3, 2, 48, 32), (17, 4, 40, 16)])
def test_hc_post_pre(T: int, n: int, D: int, block_d: int, dtype: torch.dtype, norm: bool) -> None:
    y, residual, post, comb = _post_inputs(T, n, D, dtype)
    fn, scale, base = _params((2 + n) * n, n * D, 3, seed=25)
    w = _norm_weight(D) if norm else None
    args = (fn, scale, base, EPS, EPS, 20, w)
    x, y2, post2, comb2 = mhc.hc_post_pre(
        y, residual, post, comb, *args, fused=True, block_d=block_d
    )
    # the new streams: the unfused hc_post's, bit for bit
    x0 = mhc.hc_post(y, residual, post, comb)
    assert x.dtype == dtype and torch.equal(x, x0)
    # the next sublayer's inputs: the reference on the same streams (summation order only)
    y_ref, post_ref, comb_ref = ref.hc_pre(x0, fn, scale, base, EPS, EPS, 20, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert _rel(y2, y_ref) < tol, f"y: {_rel(y2, y_ref):.2e}"
    assert _rel(post2, post_ref) < 1e-5 and _rel(comb2, comb_ref) < 1e-5
    # and the whole op against the fp32 reference
    want = ref.hc_post_pre(y.float(), residual.float(), post, comb, *args)
    assert _rel(y2, want[1]) < TOL[dtype], f"{_rel(y2, want[1]):.2e}"
    # the unfused pair (the default above POST_PRE_MAX_T tokens)
    got = mhc.hc_post_pre(y, residual, post, comb, *args, fused=False)
    assert torch.equal(got[0], x0) and _rel(got[1], y2) < tol


def test_norm_weight_checked() -> None:
    n, D = 4, 32
    fn, scale, base = _params((2 + n) * n, n * D, 3)
    x = _x(2, n, D, torch.float32)
    with pytest.raises(AssertionError, match="weight must be a contiguous"):
        mhc.hc_pre(x, fn, scale, base, EPS, EPS, 20, torch.ones(D + 1))


def _post_inputs(T: int, n: int, D: int, dtype: torch.dtype, device: str = "cpu"):  # noqa: ANN202
    g = torch.Generator().manual_seed(10)
    y = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
    residual = (3 * torch.randn(T, n, D, generator=g)).to(device=device, dtype=dtype)
    post = (2 * torch.rand(T, n, generator=g)).to(device)
    comb = torch.rand(T, n, n, generator=g).to(device)  # not symmetric: catches a missing transpose
    return y, residual, post, comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,D", [(1, 4, 64), (3, 2, 48), (17, 4, 32), (2, 4, 300)])
def test_hc_post(T: int, n: int, D: int, dtype: torch.dtype) -> None:
    y, residual, post, comb = _post_inputs(T, n, D, dtype)
    out = mhc.hc_post(y, residual, post, comb)
    out_ref = ref.hc_post(y.float(), residual.float(), post, comb)
    assert out.dtype == dtype and out.shape == (T, n, D)
    assert _rel(out, out_ref) < TOL[dtype], f"{_rel(out, out_ref):.2e}"


def test_hc_post_strided_y() -> None:
    # y as a column slice of a wider activation (row stride != D)
    y, residual, post, comb = _post_inputs(3, 4, 32, torch.float32)
    wide = torch.randn(3, 80)
    wide[:, 16:48] = y
    out = mhc.hc_post(wide[:, 16:48], residual, post, comb)
    assert _rel(out, ref.hc_post(y, residual, post, comb)) < 1e-5


def test_bad_args() -> None:
    n, D = 4, 32
    fn, scale, base = _params((2 + n) * n, n * D, 3)
    x = _x(2, n, D, torch.float32)
    with pytest.raises(AssertionError, match="hc_fn"):
        mhc.hc_pre(x, fn.double(), scale, base, EPS, EPS, 20)
    with pytest.raises(AssertionError, match="hc_fn shape"):
        mhc.hc_pre(x, fn[:, :-1].contiguous(), scale, base, EPS, EPS, 20)
    with pytest.raises(AssertionError, match="contiguous"):
        mhc.hc_pre(x.transpose(0, 1).contiguous().transpose(0, 1), fn, scale, base, EPS, EPS, 20)
    y, residual, post, comb = _post_inputs(2, n, D, torch.float32)
    with pytest.raises(AssertionError, match="comb"):
        mhc.hc_post(y, residual, post, comb.double())


# ---- GPU, Flash shapes: n=4, D=4096, bf16 activations, fp32 params, 20 Sinkhorn iterations


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_mhc_gpu_flash(T: int) -> None:
    n, D, iters, dev = 4, 4096, 20, "cuda"
    x = _x(T, n, D, torch.bfloat16, dev, seed=11)

    fn, scale, base = _params((2 + n) * n, n * D, 3, dev, seed=12)
    y, post, comb = mhc.hc_pre(x, fn, scale, base, EPS, EPS, iters)
    _check_pre((y, post, comb), x, fn, scale, base, iters, GPU_TOL_FP32)

    fh, sh, bh = _params(n, n * D, 1, dev, seed=13)
    h = mhc.hc_head(x, fh, sh, bh, EPS, EPS)
    assert _rel(h, ref.hc_head(x.float(), fh, sh, bh, EPS, EPS)) < TOL[torch.bfloat16]

    w = _norm_weight(D, dev)  # the collapse through the block's norm (one finish program a token)
    y_n = mhc.hc_pre(x, fn, scale, base, EPS, EPS, iters, w)[0]
    y_ref = ref.hc_pre(x.float(), fn, scale, base, EPS, EPS, iters, w)[0]
    assert _rel(y_n, y_ref) < TOL[torch.bfloat16], f"{_rel(y_n, y_ref):.2e}"
    assert _rel(y_n, ref.rms_norm(y, w, EPS)) < 2e-3, f"{_rel(y_n, ref.rms_norm(y, w, EPS)):.2e}"

    # hc_post_pre: the fused form against the unfused pair at Flash shapes
    pp_args = (fn, scale, base, EPS, EPS, iters, w)
    fused = mhc.hc_post_pre(y, x, post, comb, *pp_args, fused=True)
    unfused = mhc.hc_post_pre(y, x, post, comb, *pp_args, fused=False)
    assert torch.equal(fused[0], unfused[0])
    assert _rel(fused[1], unfused[1]) < 2e-3 and _rel(fused[3], unfused[3]) < GPU_TOL_FP32

    out = mhc.hc_post(y, x, post, comb)
    out_ref = ref.hc_post(y.float(), x.float(), post, comb)
    assert out.dtype == torch.bfloat16
    assert _rel(out, out_ref) < TOL[torch.bfloat16], f"{_rel(out, out_ref):.2e}"


@pytest.mark.gpu
def test_gpu_hc_pre_compiles_once_per_token_tile() -> None:
    # hc_pre's split-K partials take the token count unspecialized: counts in one BLOCK_T's
    # range (33..64: 32-token tiles) meet no Triton compile once one of them ran
    import logging

    from dsv4.ops.device import CompileWatch

    n, D, iters = 4, 256, 20
    x = _x(64, n, D, torch.bfloat16, "cuda", seed=3)
    fn, scale, base = _params((2 + n) * n, n * D, 3, "cuda", seed=4)
    mhc.hc_pre(x[:33], fn, scale, base, EPS, EPS, iters)
    watch = CompileWatch(logging.getLogger("test.mhc")).install()
    try:
        for T in (34, 48, 50, 64):
            mhc.hc_pre(x[:T], fn, scale, base, EPS, EPS, iters)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert [k for k in watch.names if "mixes" in k] == [], watch.names
