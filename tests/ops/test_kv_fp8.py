"""FP8 state entries: the byte format (dsv4.quant) against the reference's FP8 simulation, and the
Triton store / gather helpers (dsv4.ops.kv_fp8) through the ops that use them, byte for byte. Then
the FP8 indexer keys (codes + one scale per key) through compress_store and index_topk."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops import indexer, kv_fp8, ref, rope
from dsv4.ops.sparse_attn import sparse_attn
from dsv4.quant import (
    dequant_index_keys,
    dequant_kv_entries,
    index_key_bytes,
    kv_entry_layout,
    quant_index_keys,
    quant_kv_entries,
)


def _ref_sim(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    # spec 3.3, written independently: blocks of 64 nope channels, s = 2^ceil(log2(max(amax,
    # 1e-4) / 448)), e4m3(clamp(x / s)) * s; the rope channels as bf16
    n, d = x.shape
    nope = d - rope_dim
    out = x.float().clone()
    for b0 in range(0, nope, 64):
        blk = x[:, b0 : min(b0 + 64, nope)].float()
        amax = blk.abs().amax(1, keepdim=True).clamp(min=1e-4).double()
        s = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()
        out[:, b0 : b0 + blk.shape[1]] = (blk / s).clamp(-448, 448).to(
            torch.float8_e4m3fn
        ).float() * s
    out[:, nope:] = x[:, nope:].to(torch.bfloat16).float()
    return out


def _rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    # rows over 18 binades, a zero row, signed zeros, e4m3 ties and subnormals, the 448 edge
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-12, 6, n)[:, None]
    x[0] = 0.0
    x[1, :7] = -0.0
    edge = torch.tensor(
        [448.0, -448.0, 2**-10, 3 * 2**-10, -(2**-9), 2**-6 * 1.0625, 1.0625, 1.1875]
    )
    x[2, : edge.numel()] = edge  # amax 448: s = 1, the values exactly on ties
    x[3, : edge.numel()] = edge * 2**-20
    return x


def test_flash_entry_is_584_bytes():
    assert kv_entry_layout(512, 64) == (448, 7, 584)  # 448 e4m3 + 128 rope + 7 scales + 1 pad
    assert kv_entry_layout(32, 16) == (16, 1, 56)


@pytest.mark.parametrize("d,rd", [(512, 64), (128, 32), (32, 16), (100, 20)])
def test_entries_are_the_reference_fp8_simulation(d: int, rd: int):
    x = _rows(40, d)
    e = quant_kv_entries(x, rd)
    assert e.dtype == torch.uint8 and e.shape == (40, kv_entry_layout(d, rd)[2])
    assert torch.equal(dequant_kv_entries(e, d, rd), _ref_sim(x, rd))
    assert torch.equal(dequant_kv_entries(e.view(4, 10, -1), d, rd), _ref_sim(x, rd).view(4, 10, d))


def test_scale_bytes_and_signs():
    x = torch.zeros(2, 512)
    x[0, :64] = 448.0 * 2**-3  # amax / 448 = 2^-3 exactly: s = 2^-3, code 448 = 0x7E
    x[0, 64:128] = -1.0
    x[1, :64] = -0.0
    e = quant_kv_entries(x, 64)
    scales = e[:, 576:583].int() - 127
    assert scales[0, 0] == -3 and scales[0, 1] == -8  # 1 / 448 -> 2^ceil(log2) = 2^-8
    assert scales[1, 0] == -22  # the 1e-4 floor: ceil(log2(1e-4 / 448)) = -22
    assert int(e[0, 0]) == 0x7E and int(e[0, 64]) & 0x80
    assert torch.all(e[1, :64] == 0x80)  # -0.0 keeps its sign, as torch's e4m3 cast


def test_bad_entries_are_named():
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 584\]"):
        dequant_kv_entries(torch.zeros(3, 583, dtype=torch.uint8), 512, 64)
    with pytest.raises(ValueError, match="uint8"):
        dequant_kv_entries(torch.zeros(3, 584), 512, 64)
    with pytest.raises(ValueError, match="no nope channels"):
        kv_entry_layout(64, 64)


@triton.jit
def _roundtrip_kernel(
    x_ptr, e_ptr, o_ptr, n, d, nope, E, BR: tl.constexpr, BD: tl.constexpr, DECODE: tl.constexpr = 0
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < n
    c = tl.arange(0, BD)
    at = r[:, None] * d + c[None, :]
    y = tl.load(x_ptr + at, mask=ok[:, None] & (c < d)[None, :], other=0.0)
    kv_fp8.store_entries(e_ptr, r.to(tl.int64) * E, y, ok, d, nope, BR, BD)
    v = kv_fp8.load_entries(e_ptr + r.to(tl.int64) * E, ok, 0, d, nope, BR, BD, DECODE)
    tl.store(o_ptr + at, v.to(tl.float32), mask=ok[:, None] & (c < d)[None, :])


@pytest.mark.parametrize("d,rd", [(512, 64), (128, 32), (32, 16), (100, 20)])
def test_triton_store_and_load_are_bit_exact(d: int, rd: int):
    x = _rows(37, d, seed=d).bfloat16().float()
    nope, n_scales, E = kv_entry_layout(d, rd)
    e = torch.zeros(37, E, dtype=torch.uint8)
    o = torch.zeros(37, d)
    bd = triton.next_power_of_2(d)
    _roundtrip_kernel[(triton.cdiv(37, 8),)](x, e, o, 37, d, nope, E, BR=8, BD=bd)
    assert torch.equal(e, quant_kv_entries(x, rd))  # the pad byte stays 0 as well
    assert torch.equal(o, dequant_kv_entries(e, d, rd))


def test_triton_bf16_rounding_ties_to_even():
    # fp32 values half-way between bf16 neighbours: the rope bytes round to the even neighbour
    x = torch.zeros(4, 32)
    x[:, 16:] = (1.0 + torch.arange(16) * 2**-7 + 2**-8)[None, :]  # ties between bf16 steps
    nope, _, E = kv_entry_layout(32, 16)
    e = torch.zeros(4, E, dtype=torch.uint8)
    _roundtrip_kernel[(1,)](x, e, torch.zeros(4, 32), 4, 32, nope, E, BR=4, BD=32)
    assert torch.equal(e, quant_kv_entries(x, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_stores_entries(dtype: torch.dtype):
    torch.manual_seed(1)
    T, d, rd = 6, 128, 32
    x = (torch.randn(T, d) * 3).to(dtype)
    w = torch.rand(d) + 0.5
    ang = torch.rand(T, rd // 2)
    E = kv_entry_layout(d, rd)[2]
    got, want = (torch.zeros(9, E, dtype=torch.uint8) for _ in range(2))
    rows = torch.tensor([3, 0, 8, 5, 1, 7])
    out = rope.norm_rope(x, w, 1e-6, ang.cos(), ang.sin(), store=(got, rows))
    ref.norm_rope(x, w, 1e-6, ang.cos(), ang.sin(), store=(want, rows))
    if dtype == torch.float32:  # the interpreter truncates fp32 -> bf16 casts of its own
        assert torch.equal(got, want)
    # what is stored is out's rows as FP8 entries
    assert torch.equal(got[rows], quant_kv_entries(out, rd))
    assert torch.all(got[[2, 4, 6]] == 0)


@pytest.mark.parametrize("gather", [False, True])
def test_compress_store_writes_entries(gather: bool):
    torch.manual_seed(2)
    n, slots, d, rd = 5, 8, 128, 32
    kv, score = torch.randn(n * slots, d), torch.randn(n * slots, d)
    score[3] = float("-inf")
    w = torch.rand(d) + 0.5
    ang = torch.rand(n, rd // 2)
    dest = torch.tensor([4, -1, 0, 6, 2])
    E = kv_entry_layout(d, rd)[2]
    got, want = (torch.zeros(8, E, dtype=torch.uint8) for _ in range(2))
    if gather:
        rows = torch.arange(n * slots).view(n, slots)
        rows[0, :3] = -1
        args = (kv, score, w, 1e-6, ang.cos(), ang.sin())
        rope.compress_store(*args, got, dest, rows=rows)
        ref.compress_store(*args, want, dest, rows=rows)
    else:
        args = (kv.view(n, slots, d), score.view(n, slots, d), w, 1e-6, ang.cos(), ang.sin())
        rope.compress_store(*args, got, dest)
        ref.compress_store(*args, want, dest)
    assert torch.equal(got, want)
    assert torch.all(got[[1, 3, 5, 7]] == 0)


@pytest.mark.parametrize(
    "config,splits", [(None, None), ({"DV_SPLIT": 2}, 2), ({"KEYS_ON_M": True}, 3)]
)
@pytest.mark.parametrize("D,rd,H", [(32, 16, 4), (128, 32, 16)])
def test_sparse_attn_reads_entries(
    config: dict | None, splits: int | None, D: int, rd: int, H: int
):
    # entries from two sources: as the reference over the decoded rows
    g = torch.Generator().manual_seed(D)
    T, K = 3, 40
    q = torch.randn(T, H, D, generator=g)
    a, b = (quant_kv_entries(torch.randn(n, D, generator=g), rd) for n in (50, 30))
    idx = torch.randint(-1, 80, (T, K), generator=g)
    sink = torch.randn(H, generator=g)
    o = sparse_attn(q, (a, b), sink, idx, 0.1, rd, num_splits=splits, config=config)
    rows = (dequant_kv_entries(a, D, rd), dequant_kv_entries(b, D, rd))
    want = ref.sparse_attn(q, rows, sink, idx, 0.1)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.sparse_attn(q, (a, b), sink, idx, 0.1, rd), want)


def test_sparse_attn_rejects_mixed_sources():
    q = torch.randn(1, 4, 32)
    e = quant_kv_entries(torch.randn(5, 32), 16)
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(AssertionError, match="all uint8 FP8 entries"):
        sparse_attn(q, (e, torch.randn(5, 32)), torch.zeros(4), idx, 0.1, 16)
    with pytest.raises(AssertionError, match=r"must be \[N, 48\]"):  # entries of rope_dim 8
        sparse_attn(q, (e,), torch.zeros(4), idx, 0.1, 8)


# ---- FP8 indexer keys: d e4m3 codes and one power-of-two fp32 scale per key


def test_index_keys_are_the_reference_rounding():
    # act_quant over the whole key, written independently: s = 2^ceil(log2(max(amax, 1e-4) / 448))
    assert index_key_bytes(128) == 132  # vLLM's FP8 indexer key
    x = _rows(40, 128, seed=5)
    codes, scale = quant_index_keys(x)
    assert codes.dtype == torch.uint8 and codes.shape == (40, 128) and scale.shape == (40,)
    amax = x.abs().amax(1, keepdim=True).clamp(min=1e-4).double()
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()
    want = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(scale, s[:, 0])
    assert torch.equal(dequant_index_keys(codes, scale), want)
    assert torch.equal(
        dequant_index_keys(codes.view(4, 10, 128), scale.view(4, 10)), want.view(4, 10, 128)
    )


def test_bad_index_keys_are_named():
    codes, scale = quant_index_keys(torch.randn(6, 32))
    with pytest.raises(ValueError, match="uint8 codes and fp32 scales"):
        dequant_index_keys(codes.float(), scale)
    with pytest.raises(ValueError, match="do not match"):
        dequant_index_keys(codes, scale[:5])
    q, w, cand = torch.randn(1, 2, 32), torch.randn(1, 2), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(AssertionError, match="need key_scale"):
        indexer.index_topk(q, w, codes, cand, 2)
    with pytest.raises(AssertionError, match="key_scale"):
        indexer.index_topk(q, w, codes, cand, 2, scale[:5])
    kv = torch.randn(1, 4, 32)
    cs = torch.ones(1, 8)
    with pytest.raises(AssertionError, match="uint8 codes, out_scale fp32"):
        rope.compress_store(
            kv,
            kv,
            None,
            1e-6,
            cs,
            cs * 0,
            torch.zeros(6, 32),
            torch.zeros(1, dtype=torch.long),
            None,
            scale,
        )


@pytest.mark.parametrize("gather", [False, True])
def test_compress_store_writes_index_keys(gather: bool):
    torch.manual_seed(3)
    n, slots, d, rd = 5, 8, 128, 64
    kv, score = torch.randn(n * slots, d) * 4, torch.randn(n * slots, d)
    score[3] = float("-inf")
    w = torch.rand(d) + 0.5
    ang = torch.rand(n, rd // 2)
    dest = torch.tensor([4, -1, 0, 6, 2])
    got, want = (torch.zeros(8, d, dtype=torch.uint8) for _ in range(2))
    got_s, want_s = torch.zeros(8), torch.zeros(8)
    rows = torch.arange(n * slots).view(n, slots) if gather else None
    if gather:
        rows[0, :3] = -1
        args = (kv, score, w, 1e-6, ang.cos(), ang.sin())
    else:
        args = (kv.view(n, slots, d), score.view(n, slots, d), w, 1e-6, ang.cos(), ang.sin())
    rope.compress_store(*args, got, dest, rows, got_s)
    ref.compress_store(*args, want, dest, rows, want_s)
    assert torch.equal(got, want) and torch.equal(got_s, want_s)
    assert torch.all(got[[1, 3, 5, 7]] == 0) and torch.all(got_s[[1, 3, 5, 7]] == 0)
    # what is stored is the bf16 value store's rows as FP8 keys
    vals = torch.zeros(8, d, dtype=torch.bfloat16)
    ref.compress_store(*args, vals, dest, rows)
    codes, scale = quant_index_keys(vals[[4, 0, 6, 2]])
    assert torch.equal(got[[4, 0, 6, 2]], codes) and torch.equal(got_s[[4, 0, 6, 2]], scale)


@pytest.mark.parametrize("select", ["levels", "hist"])
@pytest.mark.parametrize("T,C,topk", [(3, 300, 64), (2, 40, 8)])
def test_index_topk_reads_index_keys(select: str, T: int, C: int, topk: int):
    # the positions of the reference over the decoded keys (the scale after the head sum is exact)
    g = torch.Generator().manual_seed(C)
    Hi, d, N = 16, 32, 2 * C + 3
    q, w = torch.randn(T, Hi, d, generator=g), torch.randn(T, Hi, generator=g) * Hi**-0.5
    keys = torch.randn(N, d, generator=g) * torch.logspace(-3, 3, N)[:, None]
    codes, scale = quant_index_keys(keys)
    cand = torch.stack([torch.randperm(N, generator=g)[:C] for _ in range(T)])
    cand[torch.rand(T, C, generator=g) < 0.3] = -1
    got = indexer.index_topk(q, w, codes, cand, topk, scale, select=select)
    want = ref.index_topk(q, w, dequant_index_keys(codes, scale), cand, topk)
    assert torch.equal(got, want)
    assert torch.equal(ref.index_topk(q, w, codes, cand, topk, scale), want)


# ---- GPU: Flash width (head_dim 512, rope 64), bytes exact against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [0, 1])
def test_gpu_every_decode_is_exact(decode: int):
    # the integer decode and the GPU's e4m3 conversion
    x = _rows(64, 512, seed=decode).bfloat16().float().cuda()
    e = torch.zeros(64, 584, dtype=torch.uint8, device="cuda")
    o = torch.zeros(64, 512, device="cuda")
    _roundtrip_kernel[(8,)](x, e, o, 64, 512, 448, 584, BR=8, BD=512, DECODE=decode)
    assert torch.equal(e, quant_kv_entries(x, 64))
    assert torch.equal(o, dequant_kv_entries(e, 512, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_flash_stores_entries(T: int):
    torch.manual_seed(3)
    dev = "cuda"
    x = (torch.randn(T, 512, device=dev) * 2).bfloat16()
    w = torch.rand(512, device=dev) + 0.5
    ang = torch.rand(T, 32, device=dev)
    rows = torch.randperm(1000, device=dev)[:T]
    got, want = (torch.zeros(1000, 584, dtype=torch.uint8, device=dev) for _ in range(2))
    rope.norm_rope(x, w, 1e-6, ang.cos(), ang.sin(), store=(got, rows))
    ref.norm_rope(x, w, 1e-6, ang.cos(), ang.sin(), store=(want, rows))
    assert torch.equal(got, want)
    n, slots = 16, 8
    kv, score = torch.randn(n, slots, 512, device=dev), torch.randn(n, slots, 512, device=dev)
    ang = torch.rand(n, 32, device=dev)
    dest = torch.randperm(1000, device=dev)[:n]
    rope.compress_store(kv, score, w, 1e-6, ang.cos(), ang.sin(), got, dest)
    ref.compress_store(kv, score, w, 1e-6, ang.cos(), ang.sin(), want, dest)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64])
def test_gpu_flash_attention_over_entries(T: int):
    # the engine's decode form over FP8 entries: ring | pool one allocation, 128 + 512 keys
    g = torch.Generator(device="cuda").manual_seed(T)
    dev, seqs, per_seq, W = "cuda", 64, 4096, 128
    q = torch.randn(T, 64, 512, device=dev, generator=g).bfloat16()
    rows = torch.randn(seqs * (W + per_seq), 512, device=dev, generator=g).bfloat16()
    pool = quant_kv_entries(rows, 64)
    seq = torch.arange(T, device=dev) % seqs
    win = seq[:, None] * W + torch.arange(W, device=dev)
    ent = torch.rand(T, per_seq, device=dev, generator=g).topk(512, dim=1).indices
    idx = torch.cat([win, seqs * W + seq[:, None] * per_seq + ent], dim=1)
    idx[0, -100:] = -1
    sink = torch.randn(64, device=dev, generator=g)
    kv = (pool[: seqs * W], pool[seqs * W :])
    o = sparse_attn(q, kv, sink, idx, 512**-0.5, 64)
    want = ref.sparse_attn(q.float(), (dequant_kv_entries(pool, 512, 64),), sink, idx, 512**-0.5)
    rel = float((o.float() - want).norm() / want.norm())
    assert o.dtype == torch.bfloat16 and rel < 1e-2, f"{rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_index_topk_over_fp8_keys(T: int):
    # integer keys in [-2, 2] are exact as FP8 keys (scale 2^-7): the kernel's positions equal the
    # reference's over the plain keys, tie rule included, at the decode size of 128K context
    g = torch.Generator().manual_seed(T)
    C, N = 32768, 40000
    q = torch.randint(-2, 3, (T, 64, 128), generator=g).bfloat16().cuda()
    w = (torch.randint(-2, 4, (T, 64), generator=g).float() * 0.5).cuda()
    keys = torch.randint(-2, 3, (N, 128), generator=g).float()
    codes, scale = quant_index_keys(keys.cuda())
    cand = torch.stack([torch.randperm(N, generator=g)[:C] for _ in range(T)]).cuda()
    cand[:, C - C // 8 :] = -1
    got = indexer.index_topk(q, w, codes, cand, 512, scale)
    assert torch.equal(got, ref.index_topk(q, w, keys.bfloat16().cuda(), cand, 512))


@pytest.mark.gpu
def test_gpu_compress_store_writes_index_keys():
    torch.manual_seed(4)
    n, slots, d = 16, 8, 128
    kv, score = torch.randn(n, slots, d, device="cuda") * 4, torch.randn(n, slots, d, device="cuda")
    w = torch.rand(d, device="cuda") + 0.5
    ang = torch.rand(n, 32, device="cuda")
    dest = torch.randperm(1000, device="cuda")[:n]
    got, want = (torch.zeros(1000, d, dtype=torch.uint8, device="cuda") for _ in range(2))
    got_s, want_s = (torch.zeros(1000, device="cuda") for _ in range(2))
    rope.compress_store(kv, score, w, 1e-6, ang.cos(), ang.sin(), got, dest, None, got_s)
    ref.compress_store(kv, score, w, 1e-6, ang.cos(), ang.sin(), want, dest, None, want_s)
    assert torch.equal(got, want) and torch.equal(got_s, want_s)
