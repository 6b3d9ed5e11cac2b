"""Triton sparse_attn against the torch reference in dsv4.ops.ref."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import ref
from dsv4.ops import sparse_attn as sa_mod
from dsv4.ops.rope import rotary
from dsv4.ops.sparse_attn import _configs, sparse_attn

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative-norm error against an fp32 reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _inputs(
    T: int,
    H: int,
    D: int,
    K: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    # q: [T, H, D] ; kv: sources of `sizes` rows ; sink: [H] ; idx: [T, K] with ~30% -1 anywhere
    # and (T > 1) an all -1 row 1
    g = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(T, H, D, generator=g)).to(dtype).to(device)
    kv = tuple(torch.randn(n, D, generator=g).to(dtype).to(device) for n in sizes)
    sink = torch.randn(H, generator=g).to(device)
    idx = torch.randint(0, sum(sizes), (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < 0.3] = -1
    if T > 1:
        idx[1] = -1
    return q, kv, sink, idx.to(device)


def _want(q, kv, sink, idx, scale):  # noqa: ANN001, ANN202  (fp32 reference on upcast inputs)
    return ref.sparse_attn(q.float(), tuple(s.float() for s in kv), sink, idx, scale)


# (T, H, D, K, source sizes): 1..3 uneven sources (one empty), K from 1 to 40, padded heads
SHAPES = [
    (1, 4, 32, 1, (9,)),
    (3, 4, 32, 7, (5, 9)),
    (5, 16, 64, 40, (30, 3, 70)),
    (5, 4, 32, 40, (0, 6, 30)),
    (3, 8, 64, 40, (17, 40)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D,K,sizes", SHAPES)
def test_matches_ref(
    T: int, H: int, D: int, K: int, sizes: tuple[int, ...], dtype: torch.dtype
) -> None:
    q, kv, sink, idx = _inputs(T, H, D, K, sizes, dtype)
    o = sparse_attn(q, kv, sink, idx, D**-0.5)
    assert o.shape == q.shape and o.dtype == dtype
    want = _want(q, kv, sink, idx, D**-0.5)
    assert _rel(o, want) < TOL[dtype], f"{_rel(o, want):.2e}"
    if T > 1:
        assert torch.all(o[1] == 0)  # all -1: only the sink remains, and its mass is dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"BLOCK_N": 32, "DV_SPLIT": 2},
        {"KEYS_ON_M": True},
        {"KEYS_ON_M": True, "DV_SPLIT": 2},
        {"PREFETCH": True},
        {"PREFETCH": True, "DV_SPLIT": 2, "num_stages": 3},
    ],
)
def test_split_matches_unsplit(config: dict | None, dtype: torch.dtype) -> None:
    # flash-decoding (partials + combine) against one program per token, and both against ref
    T, H, D, K = 5, 4, 32, 40
    q, kv, sink, idx = _inputs(T, H, D, K, (30, 3, 70), dtype, seed=1)
    want = _want(q, kv, sink, idx, 0.3)
    o1 = sparse_attn(q, kv, sink, idx, 0.3, num_splits=1, config=config)
    assert _rel(o1, want) < TOL[dtype]
    splits = (3, 7, 40) if config is None and dtype == torch.float32 else (2, 7)  # 40: 1 key each
    for s in splits:
        o = sparse_attn(q, kv, sink, idx, 0.3, num_splits=s, config=config)
        assert _rel(o, want) < TOL[dtype], f"num_splits={s}: {_rel(o, want):.2e}"
        if dtype == torch.float32:
            torch.testing.assert_close(o, o1, rtol=1e-5, atol=1e-6)
        assert torch.all(o[1] == 0)


@pytest.mark.parametrize("keys_on_m", [False, True])
@pytest.mark.parametrize("dv_split", [1, 2])
def test_head_blocks(dv_split: int, keys_on_m: bool) -> None:
    # BLOCK_H=16 over H=40: three head blocks, the last one partly masked; split and unsplit
    T, H, D, K = 3, 40, 32, 40
    q, kv, sink, idx = _inputs(T, H, D, K, (30, 3, 70), torch.float32, seed=4)
    want = _want(q, kv, sink, idx, 0.3)
    cfg = {"BLOCK_N": 16, "DV_SPLIT": dv_split, "BLOCK_H": 16, "KEYS_ON_M": keys_on_m}
    for s in (1, 3):
        o = sparse_attn(q, kv, sink, idx, 0.3, num_splits=s, config=cfg)
        assert _rel(o, want) < TOL[torch.float32], f"num_splits={s}: {_rel(o, want):.2e}"


def test_combine_in_several_blocks() -> None:
    # 70 splits of one key at D=256: the combine merges them online in two blocks of <= 64
    T, H, D, K = 2, 4, 256, 70
    q, kv, sink, idx = _inputs(T, H, D, K, (40, 50), torch.float32, seed=5)
    want = _want(q, kv, sink, idx, 0.1)
    o = sparse_attn(q, kv, sink, idx, 0.1, num_splits=70)
    assert _rel(o, want) < TOL[torch.float32], f"{_rel(o, want):.2e}"
    torch.testing.assert_close(
        o, sparse_attn(q, kv, sink, idx, 0.1, num_splits=1), rtol=1e-5, atol=1e-6
    )


def _cos_sin(T: int, rd: int, device: str = "cpu", seed: int = 3) -> tuple:
    ang = torch.rand(T, rd // 2, generator=torch.Generator().manual_seed(seed)) * 6.0
    return ang.cos().to(device), ang.sin().to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 70])
def test_inverse_rope_fused(splits: int, dtype: torch.dtype) -> None:
    # inv_rope: split, the combine rotates the rope channels back in its own launch; unsplit, a
    # rotary launch. Either way the outputs equal rotary(sparse_attn(..), inverse) bit for bit
    # (the combine casts o before it rotates, as the unfused pair does), and the reference's too
    q, kv, sink, idx = _inputs(5, 4, 64, 40, (30, 3, 70), dtype)
    cs = _cos_sin(5, 16)
    plain = sparse_attn(q, kv, sink, idx, 0.3, num_splits=splits)
    got = sparse_attn(q, kv, sink, idx, 0.3, num_splits=splits, inv_rope=cs)
    assert torch.equal(got, rotary(plain, *cs, inverse=True))
    assert not torch.equal(got[..., -16:], plain[..., -16:])  # the rope channels did turn
    assert torch.equal(got[..., :-16], plain[..., :-16])
    want = ref.sparse_attn(q, kv, sink, idx, 0.3, inv_rope=cs)
    assert torch.equal(want, ref.rotary(ref.sparse_attn(q, kv, sink, idx, 0.3), *cs, inverse=True))
    assert _rel(got, want) < TOL[dtype]


def test_int32_indices_and_strided_unaligned_rows() -> None:
    # int32 indices give the same bits as int64; sources may be column slices of wider tensors
    # (row stride 2D) or start off 16 bytes (the kernel then drops its alignment hint)
    T, H, D, K = 3, 4, 32, 40
    q, _, sink, idx = _inputs(T, H, D, K, (20, 7, 30), torch.float32, seed=2)
    wide = torch.randn(20, 2 * D)
    flat = torch.randn(7 * D + 1)
    kv = (wide[:, D:], flat[1:].view(7, D), torch.randn(30, D))
    assert kv[1].data_ptr() % 16 != 0
    o = sparse_attn(q, kv, sink, idx, 0.2)
    assert _rel(o, _want(q, kv, sink, idx, 0.2)) < TOL[torch.float32]
    assert torch.equal(sparse_attn(q, kv, sink, idx.int(), 0.2), o)


def test_sink_dominates_and_empty() -> None:
    T, H, D, K = 3, 4, 32, 7
    q, kv, sink, idx = _inputs(T, H, D, K, (9, 9), torch.float32, seed=3)
    big = sink + 30.0  # nearly all mass on the sink: tiny outputs, still relative-exact
    o = sparse_attn(q, kv, big, idx, 0.2)
    assert _rel(o, _want(q, kv, big, idx, 0.2)) < TOL[torch.float32]
    # K = 0: only the sink; T = 0: nothing
    none = idx[:, :0]
    assert torch.equal(sparse_attn(q, kv, sink, none, 0.2), _want(q, kv, sink, none, 0.2))
    assert sparse_attn(q[:0], kv, sink, idx[:0], 0.2).shape == (0, H, D)


def test_rejects_bad_inputs() -> None:
    q, kv, sink, idx = _inputs(2, 4, 32, 5, (9, 9), torch.float32)
    with pytest.raises(AssertionError, match="attn_sink"):
        sparse_attn(q, kv, sink.to(torch.bfloat16), idx, 0.2)
    with pytest.raises(AssertionError, match="kv\\[1\\] dtype"):
        sparse_attn(q, (kv[0], kv[1].to(torch.bfloat16)), sink, idx, 0.2)
    with pytest.raises(AssertionError, match="kv\\[0\\] must be"):
        sparse_attn(q, (kv[0][:, :16],), sink, idx, 0.2)
    with pytest.raises(AssertionError, match="topk_idxs"):
        sparse_attn(q, kv, sink, idx.float(), 0.2)


# ---- GPU at Flash shapes: H=64, D=512, K = 128 window + 512 selected, bf16, three sources


def _flash_inputs(T: int) -> tuple[torch.Tensor, tuple, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(T)
    H, D, W, sel, seqs, per_seq = 64, 512, 128, 512, 64, 4096
    bf = torch.bfloat16
    q = torch.randn(T, H, D, device="cuda", generator=g).to(bf)
    ring = torch.randn(seqs * W, D, device="cuda", generator=g).to(bf)
    new = torch.randn(T, D, device="cuda", generator=g).to(bf)
    pool = torch.randn(seqs * per_seq, D, device="cuda", generator=g).to(bf)
    sink = torch.randn(H, device="cuda", generator=g)
    tok = torch.arange(T, device="cuda")
    seq = tok % seqs  # token t decodes sequence t: 127 ring rows of its sequence + its own new row
    ring_rows = seq[:, None] * W + torch.arange(W - 1, device="cuda")
    win = torch.cat([ring_rows, seqs * W + tok[:, None]], dim=1)
    ent = torch.rand(T, per_seq, device="cuda", generator=g).topk(sel, dim=1).indices
    idx = torch.cat([win, seqs * W + T + seq[:, None] * per_seq + ent], dim=1)
    idx[0, -100:] = -1  # a partly padded row
    return q, (ring, new, pool), sink, idx


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None] + list(range(len(_configs()))))
@pytest.mark.parametrize("T,num_splits", [(1, None), (64, None), (64, 1)])
def test_gpu_flash(T: int, num_splits: int | None, cfg: int | None) -> None:
    # every autotuning candidate, split and unsplit, then the autotuned choice (cfg None)
    config = None
    if cfg is not None:
        c = _configs()[cfg]
        config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    q, kv, sink, idx = _flash_inputs(T)
    o = sparse_attn(q, kv, sink, idx, 512**-0.5, num_splits=num_splits, config=config)
    want = _want(q, kv, sink, idx, 512**-0.5)
    assert o.dtype == torch.bfloat16
    assert _rel(o, want) < TOL[torch.bfloat16], f"{_rel(o, want):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16, 32, 64])
def test_gpu_flash_one_source(T: int) -> None:
    # the engine's decode form: ring | pool one allocation (merged into one source), the window
    # rows in the ring; the few-token fixed tile (T <= 2), the autotuned ones and (sm_90,
    # T >= SM90_MIN_TOKENS) the Gluon kernel
    q, (ring, new, pool), sink, idx = _flash_inputs(T)
    both = torch.cat([ring, pool])
    kv = (both[: ring.shape[0]], both[ring.shape[0] :])
    n_ring = ring.shape[0]
    idx = torch.where(idx >= n_ring + T, idx - T, torch.where(idx >= n_ring, 0, idx))
    o = sparse_attn(q, kv, sink, idx, 512**-0.5)
    assert _rel(o, _want(q, (ring, pool), sink, idx, 512**-0.5)) < TOL[torch.bfloat16]
    cs = _cos_sin(T, 64, "cuda")  # the model's call: the inverse RoPE fused, bit for bit
    turned = sparse_attn(q, kv, sink, idx, 512**-0.5, 64, inv_rope=cs)
    assert torch.equal(
        turned, rotary(sparse_attn(q, kv, sink, idx, 512**-0.5, 64), *cs, inverse=True)
    )


@pytest.mark.parametrize("D", [8, 40])
def test_head_dim_not_a_power_of_two(D):  # noqa: ANN001
    # padded tiles, channels >= D masked; split and unsplit paths
    g = torch.Generator().manual_seed(D)
    T, H, K = 3, 4, 9
    q = torch.randn(T, H, D, generator=g)
    kv = (torch.randn(5, D, generator=g), torch.randn(T, D, generator=g))
    idx = torch.randint(-1, 5 + T, (T, K), generator=g)
    sink = torch.randn(H, generator=g)
    want = ref.sparse_attn(q, kv, sink, idx, D**-0.5)
    for splits in (1, 3):
        got = sparse_attn(q, kv, sink, idx, D**-0.5, num_splits=splits)
        assert float((got - want).norm() / want.norm()) < 1e-5, splits


def test_adjacent_sources_merge() -> None:
    # views that continue one another in one allocation become one source (same result as the
    # separate tensors); others stay apart, empty ones add nothing
    T, H, D, K = 3, 4, 32, 40
    q, kv, sink, idx = _inputs(T, H, D, K, (30, 3, 70), torch.float32, seed=6)
    buf = torch.cat([kv[0], kv[2]])
    ring, ent = buf[:30], buf[30:]
    assert len(sa_mod._merge_adjacent((ring, ent))) == 1
    assert len(sa_mod._merge_adjacent((ring, kv[1], ent))) == 3
    assert len(sa_mod._merge_adjacent((ring, ent[:0], ent))) == 1
    idx2 = torch.where(idx >= 33, idx - 3, torch.where(idx >= 30, -1, idx))  # drop kv[1]'s rows
    got = sparse_attn(q, (ring, ent), sink, idx2, 0.3)
    want = sparse_attn(q, (kv[0].clone(), kv[2].clone()), sink, idx2, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _rel(got, _want(q, (ring, ent), sink, idx2, 0.3)) < TOL[torch.float32]


def test_sm90_sources_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # the Gluon kernel's host half, on the CPU: which sources it takes (1..3 of one dtype, every
    # row on 16 bytes, or 8 for FP8 entries), and the offsets it is given: `_rows`' pick by index
    # range from them must land on the address of the concatenation's row, whatever the sources'
    # order in memory
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.quant import quant_kv_entries

    monkeypatch.setattr(sm90, "is_sm90", lambda device: True)
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    buf = torch.zeros(300, 512, dtype=torch.bfloat16)
    apart = (buf[200:230], torch.zeros(7, 512, dtype=torch.bfloat16), buf[10:150])
    assert sm90.supported(q, apart) and sm90.supported(q, apart[:1])
    assert not sm90.supported(q, (*apart, buf[:5]))  # four sources
    assert not sm90.supported(q, (apart[0], apart[1].float()))  # mixed dtypes
    odd = buf.view(-1)[4 : 4 + 512 * 20].view(20, 512)  # starts on 8 bytes
    assert not sm90.supported(q, (apart[0], odd))
    ent = quant_kv_entries(torch.randn(40, 512), 64)
    assert sm90.supported(q, (ent[1:9], ent[20:]), 64, entries=True)  # entries on 8 bytes
    assert not sm90.supported(q, (ent[1:9], ent[20:]), 64, entries=False)
    assert not sm90.supported(q, (ent[1:9], apart[0]), 64, entries=True)

    for kv in (apart, (apart[2], apart[0]), (ent[30:], ent[1:9], ent[12:20])):
        n0, n1, s0, s1, s2, at1, at2 = sm90._sources(kv)
        size = kv[0].element_size()
        rows = [(src, r) for src in kv for r in range(src.shape[0])]
        for j, (src, r) in enumerate(rows):  # `_rows`' arithmetic, in elements from source 0
            off = j * s0
            if len(kv) > 1 and j >= n0:
                off = at1 + (j - n0) * s1
            if len(kv) > 2 and j >= n0 + n1:
                off = at2 + (j - n0 - n1) * s2
            assert kv[0].data_ptr() + off * size == src[r].data_ptr(), (j, len(kv))


def _one_source_inputs(T: int) -> tuple[torch.Tensor, ...]:
    # the engine's decode form for the Gluon kernel: (q, ring, pool, sink, idx) with idx into
    # ring | pool as one source (the new rows already in the ring: their picks become -1)
    q, (ring, new, pool), sink, idx = _flash_inputs(T)
    n_ring = ring.shape[0]
    idx = torch.where(idx >= n_ring + T, idx - T, torch.where(idx >= n_ring, -1, idx))
    return q, ring, pool, sink, idx


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 16, 64])
@pytest.mark.parametrize("block_n,num_buf", [(64, 2), (32, 4), (16, 6)])
def test_gpu_sm90_kernel(T: int, block_n: int, num_buf: int) -> None:
    # the Gluon Hopper kernel on the engine's one-source decode form against the fp32 reference,
    # split (default), unsplit and two splits, with -1 entries and a key count that is no multiple
    # of a tile
    from dsv4.ops import sparse_attn_sm90 as sm90

    q, ring, pool, sink, idx = _one_source_inputs(T)
    if not sm90.supported(q, (ring,)):
        pytest.skip("not an sm_90 GPU")
    both = torch.cat([ring, pool])
    idx = idx[:, : idx.shape[1] - 5].contiguous()  # 635 keys
    idx[:, 7::13] = -1
    want = _want(q, (both,), sink, idx, 512**-0.5)
    cs = _cos_sin(T, 64, "cuda")
    for splits in (None, 1, 2):
        kw = dict(num_splits=splits, block_n=block_n, num_buf=num_buf)
        o = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, **kw)
        assert _rel(o, want) < TOL[torch.bfloat16], (splits, _rel(o, want))
        # the inverse RoPE in the combine's launch (split) or a rotary launch: bit for bit
        turned = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, inv_rope=cs, **kw)
        assert torch.equal(turned, rotary(o, *cs, inverse=True)), splits


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,num_splits", [(100, None), (64, 2), (33, 3)])
def test_gpu_sm90_three_sources(T: int, num_splits: int | None, fp8: bool) -> None:
    # a prefill chunk's form: ring | new rows | pool as three tensors, through the Gluon kernel.
    # The rows it gathers through the three base offsets must be those of the one concatenated
    # source: the same bits as the kernel on the concatenation (any source order in memory: the
    # pool lies below the ring here, so source 1 and 2 sit at negative offsets from source 0),
    # and the launcher's dispatch takes the same path
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.quant import dequant_kv_entries, quant_kv_entries

    q, (ring, new, pool), sink, idx = _flash_inputs(T)
    idx[:, 5::17] = -1
    if fp8:
        ring, new, pool = (quant_kv_entries(x, 64) for x in (ring, new, pool))
    if not sm90.supported(q, (ring, new, pool), 64, entries=True):
        pytest.skip("not an sm_90 GPU")
    buf = torch.empty(pool.shape[0] + new.shape[0] + ring.shape[0], ring.shape[1],
                      dtype=ring.dtype, device="cuda")  # fmt: skip
    low = buf[: pool.shape[0]]
    mid = buf[pool.shape[0] : pool.shape[0] + new.shape[0]]
    high = buf[pool.shape[0] + new.shape[0] :]
    low.copy_(pool)
    mid.copy_(new)
    high.copy_(ring)
    apart = (high, mid, low)  # ring | new | pool, at descending addresses
    one = (torch.cat([ring, new, pool]),)
    kw = dict(num_splits=num_splits)
    got = sm90.sparse_attn_sm90(q, apart, sink, idx, 512**-0.5, 64, **kw)
    assert torch.equal(got, sm90.sparse_attn_sm90(q, one, sink, idx, 512**-0.5, 64, **kw))
    rows = dequant_kv_entries(one[0], 512, 64) if fp8 else one[0]
    want = _want(q, (rows,), sink, idx, 512**-0.5)
    assert _rel(got, want) < TOL[torch.bfloat16], _rel(got, want)
    if num_splits is None:  # the dispatch: the Gluon kernel for three sources too
        assert torch.equal(sparse_attn(q, apart, sink, idx, 512**-0.5, 64), got)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T", [1, 48, 64])
def test_gpu_sm90_fixup(T: int, fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # two splits combined inside the Gluon kernel (FIXUP; each split half the heads, and split 1
    # all of them) against the combine launch: both near the fp32 reference, the same bits on
    # every call whichever split arrives last, the inverse RoPE in the kernel bit for bit the
    # rotary launch's, and the semaphores zero again afterwards (the next launch and graph
    # replays start from zero). fp8: over FP8 entries, whose acc is staged over the raw tiles and
    # the bf16 tile
    from dsv4.ops import device as dev_mod
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.quant import dequant_kv_entries, quant_kv_entries

    q, ring, pool, sink, idx = _one_source_inputs(T)
    both = torch.cat([ring, pool])
    rows = both
    if fp8:
        both = quant_kv_entries(both, 64)
        rows = dequant_kv_entries(both, 512, 64)
    if not sm90.supported(q, (both,), 64, entries=True):
        pytest.skip("not an sm_90 GPU")
    idx[:, 3::11] = -1
    want = _want(q, (rows,), sink, idx, 512**-0.5)
    kw = dict(num_splits=2, block_n=64, num_buf=2)
    monkeypatch.setattr(sm90, "FIXUP", False)
    launched = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw)
    monkeypatch.setattr(sm90, "FIXUP", True)
    fixed = [sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw) for _ in range(3)]
    assert _rel(fixed[0], want) < TOL[torch.bfloat16], _rel(fixed[0], want)
    assert _rel(fixed[0], launched) < 1e-2, _rel(fixed[0], launched)
    assert all(torch.equal(f, fixed[0]) for f in fixed[1:])
    cs = _cos_sin(T, 64, "cuda")
    turned = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, inv_rope=cs, **kw)
    assert torch.equal(turned, rotary(fixed[0], *cs, inverse=True))
    # each split combining half the heads (the default for bf16 rows at 2T <= SMs; FP8 entries
    # combine one way either way) gives split 1's whole combine's bits, with and without the
    # inverse RoPE
    monkeypatch.setattr(sm90, "FIXUP_HALVES", False)
    assert torch.equal(sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw), fixed[0])
    one_way = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, inv_rope=cs, **kw)
    assert torch.equal(one_way, turned)
    sem = dev_mod.arrival_counts("sparse_attn_sm90", q.device, 2 * sm90.FIXUP_MAX_TOKENS)
    assert int(sem.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,polls", [(64, 0), (48, 0), (300, None)])
def test_gpu_sm90_halves_handover(
    T: int, polls: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the halves combine when split 0 stops waiting for split 1 and hands it the whole combine
    # (`_half_finish`): the one-way combine's bits, with and without the inverse RoPE, and the
    # semaphores zero afterwards. polls 0: split 0 reads split 1's signal once, so it hands over
    # whenever split 1 has not yet come (and stays when it has: both paths in one launch).
    # T=300 with the launcher told there are SMs for every program: the first SM-count programs
    # dispatched are all split 0s waiting for split 1s that cannot start, which without the
    # handover is a hang (the case of an MPS client given fewer SMs than the device reports)
    from dsv4.ops import device as dev_mod
    from dsv4.ops import sparse_attn_sm90 as sm90

    q, ring, pool, sink, idx = _one_source_inputs(T)
    both = torch.cat([ring, pool])
    if not sm90.supported(q, (both,), 64):
        pytest.skip("not an sm_90 GPU")
    idx[:, 5::13] = -1
    cs = _cos_sin(T, 64, "cuda")
    kw = dict(num_splits=2, block_n=64, num_buf=2)
    monkeypatch.setattr(sm90, "FIXUP_HALVES", False)
    one_way = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw)
    one_way_rope = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, inv_rope=cs, **kw)
    monkeypatch.setattr(sm90, "FIXUP_HALVES", True)
    monkeypatch.setattr(sm90, "num_sms", lambda device, interpreter=4: 2 * T)  # halves at any T
    if polls is not None:
        monkeypatch.setattr(sm90, "HALVES_POLLS", polls)
    for _ in range(3):
        assert torch.equal(
            sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw), one_way
        )
        turned = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, inv_rope=cs, **kw)
        assert torch.equal(turned, one_way_rope)
    want = _want(q, (both,), sink, idx, 512**-0.5)
    assert _rel(one_way, want) < TOL[torch.bfloat16], _rel(one_way, want)
    sem = dev_mod.arrival_counts("sparse_attn_sm90", q.device, 2 * sm90.FIXUP_MAX_TOKENS)
    assert int(sem.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.parametrize("block_n,num_buf", [(64, 2), (32, 4)])
def test_gpu_sm90_entries(
    T: int, block_n: int, num_buf: int, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Gluon kernel over FP8 entries (off in the dispatch until this passes on a GPU): the fp32
    # reference over the decoded rows, split and unsplit, with -1 entries (overlap: S over the
    # first 256 channels in flight while the others decode)
    from dsv4.ops import sparse_attn_sm90 as sm90
    from dsv4.quant import dequant_kv_entries, quant_kv_entries

    monkeypatch.setattr(sm90, "OVERLAP", overlap)

    q, ring, pool, sink, idx = _one_source_inputs(T)
    both = torch.cat([quant_kv_entries(ring, 64), quant_kv_entries(pool, 64)])
    if not sm90.supported(q, (both,), 64, entries=True):
        pytest.skip("not an sm_90 GPU")
    idx[:, 7::13] = -1
    want = _want(q, (dequant_kv_entries(both, 512, 64),), sink, idx, 512**-0.5)
    cs = _cos_sin(T, 64, "cuda")
    for splits in (None, 1, 2):
        kw = dict(num_splits=splits, block_n=block_n, num_buf=num_buf)
        o = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, **kw)
        assert _rel(o, want) < TOL[torch.bfloat16], (splits, _rel(o, want))
        # the inverse RoPE in the kernel (raw tiles within q's 64 KB, both tilings here: unsplit,
        # two splits), the combine's launch (other splits) or a rotary launch: bit for bit
        turned = sm90.sparse_attn_sm90(q, (both,), sink, idx, 512**-0.5, 64, inv_rope=cs, **kw)
        assert torch.equal(turned, rotary(o, *cs, inverse=True)), splits


@pytest.mark.gpu
@pytest.mark.parametrize("shape", range(len(sa_mod.SMALL_SHARED_SHAPES)))
@pytest.mark.parametrize("T,num_splits", [(1, None), (64, None), (64, 1)])
def test_gpu_small_shared_entries(T: int, num_splits: int | None, shape: int) -> None:
    # the tiles that fit an sm_120 GPU's 99 KB over FP8 entries (the only ones there), run on
    # this GPU through the Triton kernel: the fp32 reference over the decoded rows, three sources
    from dsv4.quant import dequant_kv_entries, quant_kv_entries

    config = sa_mod.shape_tile(sa_mod.SMALL_SHARED_SHAPES[shape])
    q, kv, sink, idx = _flash_inputs(T)
    entries = tuple(quant_kv_entries(s, 64) for s in kv)
    want = _want(q, tuple(dequant_kv_entries(e, 512, 64) for e in entries), sink, idx, 512**-0.5)
    o = sparse_attn(q, entries, sink, idx, 512**-0.5, 64, num_splits=num_splits, config=config)
    assert _rel(o, want) < TOL[torch.bfloat16], f"{_rel(o, want):.2e}"


def test_fixed_tiles_where_measured():
    h200, sm120 = 232448, 101376  # shared memory per program
    assert sa_mod.fixed_tile(2, 64, False, h200) is sa_mod.FEW_TOKENS_TILE
    assert sa_mod.fixed_tile(2, 64, True, h200) is sa_mod.FEW_TOKENS_TILE_FP8
    assert sa_mod.fixed_tile(1, 64, False, sm120) is sa_mod.FEW_TOKENS_TILE
    assert sa_mod.fixed_tile(1, 64, True, sm120) is sa_mod.FEW_TOKENS_TILE_FP8
    assert sa_mod.fixed_tile(1, 64, True, 48 * 1024) is None  # too little shared memory
    assert sa_mod.fixed_tile(16, 64, False, h200) is None
    assert sa_mod.fixed_tile(64, 64, False, h200) is None
    assert sa_mod.fixed_tile(16, 64, True, h200) is None
    assert sa_mod.fixed_tile(64, 64, True, h200) is sa_mod.FP8_MANY_TOKENS_TILE
    assert sa_mod.fixed_tile(64, 64, True, sm120) is None  # 176 KB does not fit: autotuned
    assert sa_mod.fixed_tile(64, 16, True, h200) is None  # 16 heads: not the 64-head tile


def test_small_shared_tiles_only_on_small_gpus(monkeypatch) -> None:  # noqa: ANN001
    # the autotuner sees SMALL_SHARED_SHAPES only where shared memory is short (sm_120)
    args = {"q_ptr": torch.zeros(1), "BLOCK_D": 512, "H_PAD": 64}
    big = sa_mod._prune(_configs(), args)
    assert not {sa_mod._shape(c) for c in big} & set(sa_mod.SMALL_SHARED_SHAPES)
    monkeypatch.setattr(sa_mod, "shared_memory", lambda device: 101376)
    small = {sa_mod._shape(c) for c in sa_mod._prune(_configs(), args)}
    assert set(sa_mod.SMALL_SHARED_SHAPES) <= small and len(small) == len(big) + 4


def test_tune_key_prefill_classes() -> None:
    # a prefill (one split, the SMs filled) keys its autotune by the programs' octave and two key
    # classes; decodes (split, or few programs) by the keys per split's octave too
    key = sa_mod._tune_key
    prefill = {key(1000, 1, k, 132) for k in (129, 200, 640, 1152, 5000)}
    assert len(prefill) == 1
    assert key(1000, 1, 128, 132) != key(1000, 1, 640, 132)
    assert key(1000, 1, 640, 132) != key(3000, 1, 640, 132)  # another octave of programs
    assert key(64, 2, 320, 132) != key(64, 2, 160, 132)  # a decode's key octaves
    assert key(100, 1, 320, 132) != key(100, 1, 640, 132)  # few programs: as a decode
