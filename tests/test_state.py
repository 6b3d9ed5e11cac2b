"""State sizing (spec 9.6) and paging: any page assignment gives the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.config import flash_args
from dsv4.llm import LLM
from dsv4.state import ENTRY_ALIGN, Batch, DecodeState, bytes_per_seq, bytes_per_token
from dsv4.tiny import make_tiny, tiny_args


def test_flash_growing_state_is_6880_bytes_per_token_bf16():
    assert bytes_per_token(flash_args(), torch.bfloat16) == 6880
    # fixed part: 44 window rings of 128 x 512 bf16 plus fp32 compressor state
    rings = 44 * 128 * 1024
    assert bytes_per_seq(flash_args(), torch.bfloat16) > rings


def test_blocks_for_budget():
    a = tiny_args(vocab_size=300)
    n = DecodeState.blocks_for_budget(a, 4, 1 << 20, torch.float32, 16)
    per_block = bytes_per_token(a, torch.float32) * 16
    assert n == int((1 << 20) - 4 * bytes_per_seq(a, torch.float32)) // int(per_block)


def test_shuffled_small_pages_equal_default(tmp_path):  # noqa: ANN001
    llm = LLM(make_tiny(tmp_path / "m", tiny_args(vocab_size=300)), progress=False)
    ids = torch.randint(2, 300, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    want = llm.score(ids, chunk_size=13)
    st = DecodeState(llm.args, 2, 96, torch.float32, "cpu", num_blocks=20, block_size=16)
    st.block_table.fill_(-1)
    st.block_table[0, :6] = torch.randperm(20)[:6]
    llm._score_state = st
    got = llm.score(ids, chunk_size=13)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_decode_batch_ring_writes_without_nonzero():
    # a batch of single tokens is flagged decode and writes every token's ring slot; the general
    # path (nonzero over "last `ring` tokens of each sequence") gives the same rows
    st = DecodeState(tiny_args(vocab_size=300), 4, 64, torch.float32, "cpu", num_blocks=8)
    st.block_table[:, 0] = torch.arange(4)
    dec = Batch.build([2, 0, 3], [5, 17, 31], [1, 1, 1], st)
    assert dec.decode and not Batch.build([2, 0], [5, 17], [1, 2], st).decode
    general = dataclasses.replace(dec, decode=False, _cache={})
    for ring in (1, 4, 8):
        for a, b in zip(dec.ring_writes(ring), general.ring_writes(ring)):
            assert torch.equal(a, b)


def test_host_index_lists_match_the_device_formulas():
    # closing windows, ring writes and the visible width come from host-side (start, len) lists;
    # they equal the formulas over the device positions (what nonzero / max used to compute)
    st = DecodeState(tiny_args(vocab_size=300), 4, 512, torch.float32, "cpu", num_blocks=8)
    st.block_table[:, 0] = torch.arange(4)
    st.block_table[:, 1] = torch.arange(4, 8)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lens = torch.randint(1, 40, (3,), generator=g).tolist()
        starts = torch.randint(0, 400, (3,), generator=g).tolist()
        b = Batch.build([1, 3, 0], starts, lens, st)
        pos, seq = b.positions, b.token_seq
        for ratio in (4, 128):
            tok = b.closing_windows(ratio, ratio == 4)[0]
            assert torch.equal(tok, ((pos + 1).remainder(ratio) == 0).nonzero().squeeze(1))
            cand, count = b.visible_entries(ratio)
            # an eager step's width: the most visible, rounded up to a multiple of 16
            assert cand.shape[1] == -(-max(int(count.max()), 1) // 16) * 16
            assert cand.shape[1] % ENTRY_ALIGN == 0 and not (cand[:, int(count.max()) :] >= 0).any()
        for ring in (8, 128):
            last = pos >= b.start_pos[seq] + b.lens[seq] - ring
            assert torch.equal(b.ring_writes(ring)[0], last.nonzero().squeeze(1))


def test_ring_and_entries_share_one_allocation():
    # every compressed layer's ring is followed in memory by its compressed entries (same row
    # stride), so decode attention sees one key source; sliding layers keep the ring alone
    st = DecodeState(tiny_args(vocab_size=300), 3, 64, torch.float32, "cpu", num_blocks=8)
    for ls in st.layers:
        if ls.compressor is None:
            continue
        ring, ent = ls.window, ls.compressor.kv_cache
        assert ring.untyped_storage().data_ptr() == ent.untyped_storage().data_ptr()
        assert ent.data_ptr() == ring.data_ptr() + ring.numel() * ring.element_size()
        assert ring.stride() == ent.stride()


def test_decode_window_in_the_ring_alone():
    # after a decode step's K=V is stored at slot p % W, the ring-only window rows hold the
    # same positions as the ring | chunk rows (the new token's row moves from the chunk to its
    # ring slot), and the earlier positions map to the same ring rows
    st = DecodeState(tiny_args(vocab_size=300), 4, 64, torch.float32, "cpu", num_blocks=8)
    st.block_table[:, 0] = torch.arange(4)
    W = 8
    b = Batch.build([2, 0, 3], [5, 17, 31], [1, 1, 1], st)
    both, ring = b.window_idxs(W), b.window_idxs(W, ring_only=True)
    tok, slot_rows = b.ring_writes(W)
    new = both >= st.max_seqs * W  # the chunk rows: each token's own position
    assert int(new.sum()) == b.num_tokens
    assert torch.equal(ring[new], slot_rows[tok])
    assert torch.equal(ring[~new], both[~new])
    with pytest.raises(AssertionError, match="decode"):
        Batch.build([1], [3], [2], st).window_idxs(W, ring_only=True)


def test_hca_attention_rows_built_once_per_step():
    # the HCA layers of a step share one [T, W + C] list: the window rows, then the visible
    # entries offset by the rows before them (-1 stays -1)
    st = DecodeState(tiny_args(vocab_size=300), 4, 64, torch.float32, "cpu", num_blocks=8)
    st.block_table[:, 0] = torch.arange(4)
    for b in (Batch.build([2, 0], [5, 17], [1, 1], st), Batch.build([1], [3], [4], st)):
        W, m, base = 8, 4, 100
        got = b.attention_idxs(W, m, base)
        rows, _ = b.visible_entries(m)
        win = b.window_idxs(W, ring_only=b.decode)
        assert torch.equal(got[:, :W], win)
        assert torch.equal(got[:, W:], torch.where(rows >= 0, rows + base, -1))
        assert b.attention_idxs(W, m, base) is got


def test_csa_selected_rows_equal_the_page_formula():
    # the rows of the picked entries come from the step's visible-rows table (one gather); they
    # equal the page translation of each picked entry (entry_rows), offset by base, -1 kept
    st = DecodeState(tiny_args(vocab_size=300), 4, 512, torch.float32, "cpu", num_blocks=8)
    st.block_table[:] = torch.randperm(8).view(4, -1)[:, : st.block_table.shape[1]]
    g = torch.Generator().manual_seed(1)
    for b in (
        Batch.build([2, 0, 3], [70, 200, 9], [1, 1, 1], st),
        Batch.build([1], [40], [30], st),
    ):
        W, m, base = 8, 4, 1000
        cand, count = b.visible_entries(m)
        ent = torch.randint(-1, cand.shape[1], (b.num_tokens, 6), generator=g)
        ent = torch.where(ent < count[:, None], ent, -1)  # only visible entries are picked
        got = b.selected_idxs(W, m, base, ent)
        rows = b.entry_rows(b.token_seq[:, None].expand_as(ent), ent, m)
        assert torch.equal(got[:, :W], b.window_idxs(W, ring_only=b.decode))
        assert torch.equal(got[:, W:], torch.where(rows >= 0, rows + base, -1))
        assert bool((got[:, W:] == -1).any()) and bool((got[:, W:] >= base).any())


# ---- FP8 state entries (--kv-cache-dtype fp8)


def test_flash_fp8_state_sizes():
    a = flash_args()
    # 584-B main entries (C4 and C128), 132-B FP8 indexer keys: 21 CSA, 20 HCA layers (spec 9.6:
    # 3850 B per token, as vLLM)
    assert bytes_per_token(a, torch.bfloat16, "fp8") == 21 * (584 + 132) / 4 + 20 * 584 / 128
    assert round(bytes_per_token(a, torch.bfloat16, "fp8")) == 3850
    rings = 44 * 128 * 584
    assert bytes_per_seq(a, torch.bfloat16, "fp8") - rings == (
        bytes_per_seq(a, torch.bfloat16) - 44 * 128 * 1024
    )
    with pytest.raises(ValueError, match="kv_format"):
        bytes_per_token(a, torch.bfloat16, "fp4")


def test_fp8_state_layout_and_budget():
    a = tiny_args(vocab_size=300)
    st = DecodeState(a, 2, 64, torch.float32, "cpu", kv_format="fp8")
    for layer in st.layers:
        assert layer.window.dtype == torch.uint8 and layer.window.shape[1] == 56
        if layer.compressor is not None:  # ring | entries one allocation, as with values
            c = layer.compressor.kv_cache
            assert c.dtype == torch.uint8 and c.data_ptr() == layer.window[-1:].data_ptr() + 56
        if layer.indexer is not None:  # FP8 keys: codes and one fp32 scale per key
            ix = layer.indexer
            assert ix.kv_cache.dtype == torch.uint8 and ix.kv_cache.shape[1] == a.index_head_dim
            assert ix.kv_scale.dtype == torch.float32 and ix.kv_scale.shape == ix.kv_cache.shape[:1]
    plain = DecodeState(a, 2, 64, torch.float32, "cpu").layers
    assert all(ls.indexer.kv_scale is None for ls in plain if ls.indexer is not None)
    assert any(ls.indexer is not None for ls in plain)
    assert st.nbytes() == sum(
        t.nbytes
        for layer in st.layers
        for c in (layer.compressor, layer.indexer)
        if c is not None
        for t in (c.kv_cache, c.kv_state, c.score_state, c.kv_scale)
        if t is not None
    ) + sum(layer.window.nbytes for layer in st.layers)
    auto = DecodeState.blocks_for_budget(a, 4, 1 << 20, torch.float32, 16)
    fp8 = DecodeState.blocks_for_budget(a, 4, 1 << 20, torch.float32, 16, "fp8")
    assert fp8 > auto


def _sim_fp8(ops, rope_dim: int, head_dim: int):  # noqa: ANN001, ANN202
    # the reference's FP8 simulation (spec 3.3) on value-typed state: every window K=V row and every
    # main compressed entry passes through quant -> dequant, rope channels through bf16; the
    # indexer keys through the FP8 indexer-key form (one scale per key)
    import types

    from dsv4.quant import (
        dequant_index_keys,
        dequant_kv_entries,
        quant_index_keys,
        quant_kv_entries,
    )

    def sim(x: torch.Tensor) -> torch.Tensor:
        return dequant_kv_entries(quant_kv_entries(x, rope_dim), head_dim, rope_dim).to(x.dtype)

    def norm_rope(x, w, eps, cos, sin, store=None):  # noqa: ANN001, ANN202
        out = ops.norm_rope(x, w, eps, cos, sin)
        if w is not None and x.dim() == 2 and x.shape[-1] == head_dim:  # the window K=V
            out = sim(out)
        if store is not None:
            store[0][store[1]] = out.to(store[0].dtype)
        return out

    def norm_rope_qkv(q, kv, w, eps, cos, sin, store=None):  # noqa: ANN001, ANN202
        return ops.norm_rope(q, None, eps, cos, sin), norm_rope(kv, w, eps, cos, sin, store)

    def compress_store(kv, score, w, eps, cos, sin, out, dest, rows=None, out_scale=None,  # noqa: ANN001, ANN202
                       chunk=None):  # fmt: skip  # noqa: ANN001
        assert out_scale is None  # value state
        tmp = torch.zeros(out.shape, dtype=torch.bfloat16)  # both FP8 forms round through bf16
        ops.compress_store(kv, score, w, eps, cos, sin, tmp, dest, rows, chunk=chunk)
        keep = dest >= 0
        y = tmp[dest[keep]]
        keys = out.shape[1] != head_dim  # the indexer's
        out[dest[keep]] = (dequant_index_keys(*quant_index_keys(y)) if keys else sim(y)).to(
            out.dtype
        )

    return types.SimpleNamespace(
        **(
            vars(ops)
            | dict(norm_rope=norm_rope, norm_rope_qkv=norm_rope_qkv, compress_store=compress_store)
        )
    )


def test_fp8_state_is_the_reference_fp8_simulation(tmp_path):  # noqa: ANN001
    # fp32 compute: FP8 entries give exactly the logits of value state with the reference's
    # rounding simulated, over chunked prefill; and differ from unrounded state
    ckpt = make_tiny(tmp_path / "m", tiny_args(vocab_size=300), seed=2)
    ids = list(range(3, 60))
    fp8 = LLM(ckpt, progress=False, max_seq_len=128, kv_cache_dtype="fp8")
    assert fp8.state.layers[0].window.dtype == torch.uint8
    got = fp8.score(ids, chunk_size=16)
    sim = LLM(ckpt, progress=False, max_seq_len=128)
    plain = sim.score(ids, chunk_size=16)
    ops = _sim_fp8(sim.model.ops, sim.args.rope_head_dim, sim.args.head_dim)
    for m in sim.model.modules():
        if hasattr(m, "ops"):
            m.ops = ops
    assert torch.equal(got, sim.score(ids, chunk_size=16))
    assert not torch.allclose(got, plain, atol=1e-3)


def test_fp8_state_triton_equals_ref(tmp_path):  # noqa: ANN001
    # the Triton kernels (interpreter on the CPU) over FP8 entries: the reference's logits, and
    # the same greedy tokens through the engine's decode steps
    from dsv4.sampling import SamplingParams

    # (four Sinkhorn iterations: the interpreter's hc_pre time, test_model's reason)
    ckpt = make_tiny(tmp_path / "m", tiny_args(vocab_size=300, hc_sinkhorn_iters=4), seed=4)
    ids = list(range(5, 45))
    kw = dict(progress=False, max_seq_len=128, max_seqs=2, kv_cache_dtype="fp8")
    ref_llm, tri = LLM(ckpt, **kw), LLM(ckpt, ops="triton", **kw)
    torch.testing.assert_close(
        tri.score(ids, chunk_size=11), ref_llm.score(ids), rtol=1e-4, atol=1e-4
    )
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [ids[:9], ids[:23]]
    assert [o.token_ids for o in tri.generate(prompts, sp)] == [
        o.token_ids for o in ref_llm.generate(prompts, sp)
    ]


def test_context_table_bytes():
    # the index tables a step holds at long context beyond a fresh one: the CSA part capped at
    # one slice (ENTRY_TABLE_ELEMENTS), the HCA part growing with the context
    from dsv4.config import CSA, HCA, SLIDING
    from dsv4.state import ENTRY_TABLE_ELEMENTS, context_table_bytes

    a = tiny_args(layer_types=(SLIDING, CSA, HCA), csa_ratio=4, hca_ratio=128)
    small = context_table_bytes(a, 16, 4096)
    assert small == 16 * 1024 * 24 + 16 * 32 * 32
    big, bigger = (context_table_bytes(a, 2048, n) for n in (1 << 20, 1 << 21))
    assert big == ENTRY_TABLE_ELEMENTS * 24 + 2048 * 8192 * 32
    assert bigger - big == 2048 * 8192 * 32  # (the CSA part stays one slice)
    assert context_table_bytes(tiny_args(layer_types=(SLIDING,)), 2048, 1 << 20) == 0
