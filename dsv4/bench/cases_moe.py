"""Routed-expert cases: Flash MoE (D=4096, inter=2048, 256 MXFP4 experts, k=6) at decode batches
T = 1, 16, 64 with random routing, and the router (`moe_gate`: 256 experts, bf16 gate); quick =
tiny CPU shapes."""

from __future__ import annotations

import torch

from dsv4.bench.ops import Case
from dsv4.model import Build, Expert
from dsv4.ops import gate, moe, ref, select
from dsv4.tiny import tiny_args


def random_experts(D: int, I: int, E: int, device: str, seed: int = 0) -> torch.nn.ModuleList:  # noqa: E741
    """E Flash-layout MXFP4 experts built on `device`: random packed bytes (every e2m1 code) and
    e8m0 scales 2^-9..2^-7 (S = 118..120), so outputs stay O(1) without quantizing on the host."""
    b = Build(tiny_args(dim=D, moe_inter_dim=I), torch.bfloat16, "dense", "fp4", select("ref"))
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        experts = torch.nn.ModuleList(Expert(b, I, "fp4") for _ in range(E))
    for ex in experts:
        for lin in (ex.w1, ex.w3, ex.w2):
            w, s = lin.weight, lin.scale
            w.copy_(torch.randint(-128, 128, w.shape, generator=g, device=device, dtype=torch.int8))
            s.view(torch.uint8).copy_(
                torch.randint(118, 121, s.shape, generator=g, device=device, dtype=torch.uint8)
            )
    return experts


def _expert_bytes(ex: Expert) -> int:
    return sum(
        t.numel() * t.element_size()
        for lin in (ex.w1, ex.w3, ex.w2)
        for t in (lin.weight, lin.scale)
    )


def cases(device: str, quick: bool) -> list[Case]:
    D, I, E, k = (64, 32, 8, 2) if quick else (4096, 2048, 256, 6)  # noqa: E741
    experts = random_experts(D, I, E, device)
    per_expert = _expert_bytes(experts[0])  # 12.75 MB at Flash sizes
    out: list[Case] = []
    for T in [1, 5] if quick else [1, 16, 64]:
        g = torch.Generator(device=device).manual_seed(T)
        idx = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :k]
        weights = torch.rand(T, k, generator=g, device=device) / k
        dtype = torch.float32 if quick else torch.bfloat16
        x = torch.randn(T, D, generator=g, device=device).to(dtype)
        used = int(idx.unique().numel())
        # read the weights + scales of the distinct routed experts, x, weights, idx ; write y fp32
        nbytes = used * per_expert + x.numel() * x.element_size() + T * k * (4 + 8) + T * D * 4
        args = (x, weights, idx, experts)
        out.append(Case(
            "moe_experts",
            f"T={T} k={k} E={E} experts={used} D={D} I={I}",
            run=lambda a=args: moe.moe_experts(*a),
            ref=lambda a=args: ref.moe_experts(*a),
            bytes=nbytes,
        ))  # fmt: skip
    for T in [1, 5] if quick else [1, 16, 64]:
        g = torch.Generator(device=device).manual_seed(100 + T)
        dtype = torch.float32 if quick else torch.bfloat16
        x = torch.randn(T, D, generator=g, device=device).to(dtype)
        w = (torch.randn(E, D, generator=g, device=device) / D**0.5).to(dtype)
        bias = torch.randn(E, generator=g, device=device) * 0.1
        # read x, the gate weight and bias ; write k weights (fp32) and k ids (int64) per token
        nbytes = (x.numel() + w.numel()) * x.element_size() + E * 4 + T * k * 12
        args = (x, w, bias, k, 2.5)
        out.append(Case(
            "moe_gate", f"T={T} E={E} D={D} k={k}",
            run=lambda a=args: gate.moe_gate(*a),
            ref=lambda a=args: ref.moe_gate(*a),
            bytes=nbytes,
        ))  # fmt: skip
    return out
