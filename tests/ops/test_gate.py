"""moe_gate (Triton) against dsv4.ops.ref.moe_gate: the same experts, weights to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import gate, ref


def _inputs(T: int, E: int, D: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) / D**0.5).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1
    return x.to(device), w.to(device), bias.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,E,D,k", [(1, 16, 64, 2), (5, 32, 300, 6), (17, 24, 128, 3), (3, 64, 512, 8)]
)
def test_moe_gate_matches_reference(T: int, E: int, D: int, k: int, dtype: torch.dtype) -> None:
    x, w, bias = _inputs(T, E, D, dtype)
    wt, idx = gate.moe_gate(x, w, bias, k, 2.5)
    want_w, want_idx = ref.moe_gate(x, w, bias, k, 2.5)
    assert idx.dtype == torch.int64 and wt.dtype == torch.float32
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(wt, want_w, rtol=1e-5, atol=1e-6)


def test_moe_gate_ties_take_the_lower_expert() -> None:
    # zero weights: every score is sqrt(softplus(0)); a bias with repeated values decides
    x = torch.randn(2, 64)
    w = torch.zeros(16, 64)
    bias = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 0.5] + [0.0] * 10)
    wt, idx = gate.moe_gate(x, w, bias, 4, 1.0)
    assert idx.tolist() == [[1, 2, 4, 3]] * 2
    assert torch.equal(idx, ref.moe_gate(x, w, bias, 4, 1.0)[1])
    torch.testing.assert_close(wt, torch.full((2, 4), 0.25))


def test_moe_gate_hash_routing_and_softplus_range() -> None:
    # fixed experts per token (bias unused); large and very negative dots (softplus threshold and
    # the log1p form)
    x, w, _ = _inputs(4, 32, 128, torch.float32, seed=3)
    w[:4] *= 400.0  # dots far above 20
    w[4:8] *= -400.0  # softplus of a very negative dot: exp(z), not 0
    idx = torch.tensor([[0, 5, 9], [4, 6, 31], [1, 2, 3], [7, 8, 30]])
    wt, got = gate.moe_gate(x, w, None, 3, 1.5, idx)
    want_w, _ = ref.moe_gate(x, w, None, 3, 1.5, idx)
    assert torch.equal(got, idx)
    torch.testing.assert_close(wt, want_w, rtol=1e-5, atol=1e-7)


def test_moe_gate_checks() -> None:
    x, w, bias = _inputs(2, 16, 64, torch.float32)
    with pytest.raises(AssertionError, match="bias must be fp32"):
        gate.moe_gate(x, w, bias.double(), 2, 1.0)
    with pytest.raises(AssertionError, match="idx must be contiguous int64"):
        gate.moe_gate(x, w, None, 2, 1.0, torch.zeros(2, 3, dtype=torch.int64))
    assert gate.moe_gate(x[:0], w, bias, 2, 1.0)[1].shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 300])
def test_moe_gate_on_gpu(T: int) -> None:
    # Flash: 256 experts, D = 4096, k = 6, route_scale 2.5 (bf16 activations and gate weight)
    x, w, bias = _inputs(T, 256, 4096, torch.bfloat16, device="cuda")
    wt, idx = gate.moe_gate(x, w, bias, 6, 2.5)
    want_w, want_idx = ref.moe_gate(x, w, bias, 6, 2.5)
    # fp32 sums in another order: a near-tie may swap, so compare the chosen sets' scores
    assert (idx == want_idx).float().mean() > 0.99
    same = (idx == want_idx).all(1)
    torch.testing.assert_close(wt[same], want_w[same], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_gate_compiles_once_per_token_tile() -> None:
    # the token count is not specialized: a served step of any count in one BLOCK_T's range
    # meets no Triton compile once one count of that range ran (a late compile in a served
    # burst, docs/PERF.md thirty-first session: T even, not a multiple of 16)
    import logging

    from dsv4.ops.device import CompileWatch

    x, w, bias = _inputs(64, 24, 256, torch.bfloat16, device="cuda")
    gate.moe_gate(x[:33], w, bias, 6, 2.5)
    watch = CompileWatch(logging.getLogger("test.gate")).install()
    try:
        for T in (34, 48, 50, 64):  # (BLOCK_T 64, one token block: the same splits)
            gate.moe_gate(x[:T], w, bias, 6, 2.5)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert watch.count == 0, watch.names
