"""Benchmark cases: fused q/kv RMSNorm + RoPE (apart, and both in one launch), inverse RoPE on the
output, the compressor close, the decode step's compressor ring write."""

from __future__ import annotations

import torch

from dsv4.bench.ops import Case
from dsv4.ops import ref, rope

EPS = 1e-6


def _angles(T: int, rd: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, rd // 2, device=device) * 12.0 - 6.0
    return ang.cos(), ang.sin()


def _rows_cases(
    device: str, dtype: torch.dtype, tokens: tuple[int, ...], H: int, d: int, rd: int
) -> list[Case]:
    out = []
    for T in tokens:
        # ---- q path: per-head unweighted norm + RoPE, x [T, H, d]
        q = torch.randn(T, H, d, device=device).to(dtype)
        cos, sin = _angles(T, rd, device)
        rows_bytes = 2 * q.numel() * q.element_size() + 2 * cos.numel() * 4  # x in, out ; cos, sin
        out.append(
            Case(
                "norm_rope",
                f"q T={T} [{H},{d}]",
                run=lambda q=q, c=cos, s=sin: rope.norm_rope(q, None, EPS, c, s),
                ref=lambda q=q, c=cos, s=sin: ref.norm_rope(q, None, EPS, c, s),
                bytes=rows_bytes,
            )
        )
        # ---- inverse RoPE on the attention output o [T, H, d]
        out.append(
            Case(
                "rotary_inv",
                f"o T={T} [{H},{d}]",
                run=lambda o=q, c=cos, s=sin: rope.rotary(o, c, s, inverse=True),
                ref=lambda o=q, c=cos, s=sin: ref.rotary(o, c, s, inverse=True),
                bytes=rows_bytes,
            )
        )
    return out


def _kv_cases(
    device: str, dtype: torch.dtype, tokens: tuple[int, ...], d: int, rd: int
) -> list[Case]:
    # ---- window KV: weighted norm + RoPE, x [T, d]
    out = []
    w = torch.rand(d, device=device) + 0.5
    for T in tokens:
        kv = torch.randn(T, d, device=device).to(dtype)
        cos, sin = _angles(T, rd, device)
        out.append(
            Case(
                "norm_rope",
                f"kv T={T} [{d}]",
                run=lambda x=kv, c=cos, s=sin: rope.norm_rope(x, w, EPS, c, s),
                ref=lambda x=kv, c=cos, s=sin: ref.norm_rope(x, w, EPS, c, s),
                bytes=2 * kv.numel() * kv.element_size() + d * 4 + 2 * cos.numel() * 4,
            )
        )
    return out


def _qkv_cases(
    device: str, dtype: torch.dtype, tokens: tuple[int, ...], H: int, d: int, rd: int
) -> list[Case]:
    # ---- the attention's queries and window K=V in one launch, K=V stored into a ring
    out = []
    w = torch.rand(d, device=device) + 0.5
    for T in tokens:
        q = torch.randn(T, H, d, device=device).to(dtype)
        kv = torch.randn(T, d, device=device).to(dtype)
        cos, sin = _angles(T, rd, device)
        rows = torch.arange(T, device=device) * 2
        args = (q, kv, w, EPS, cos, sin)
        # each side its own ring
        st = tuple((torch.zeros(2 * T, d, device=device, dtype=dtype), rows) for _ in range(2))
        out.append(
            Case(
                "norm_rope_qkv",
                f"T={T} q [{H},{d}] + kv [{d}] stored",
                run=lambda a=args, st=st[0]: rope.norm_rope_qkv(*a, store=st),
                ref=lambda a=args, st=st[1]: ref.norm_rope_qkv(*a, store=st),
                # q in, out ; kv in, out, stored ; the weight ; cos, sin
                bytes=(2 * q.numel() + 3 * kv.numel()) * q.element_size()
                + d * 4
                + 2 * cos.numel() * 4,
            )
        )
    return out


def _compress_cases(
    device: str,
    windows: tuple[int, ...],
    kinds: tuple[tuple[str, int, int], ...],
    rd: int,
    pool_rows: int,
) -> list[Case]:
    # ---- pool n closed windows [n, slots, d] fp32 -> norm + RoPE -> bf16 rows of a paged pool
    out = []
    for name, slots, d in kinds:
        w = torch.rand(d, device=device) + 0.5
        for n in windows:
            kv = torch.randn(n, slots, d, device=device)
            score = torch.randn(n, slots, d, device=device)
            if slots == 8:  # CSA's first window: the A-half slots are empty
                score[0, :4] = float("-inf")
            cos, sin = _angles(n, rd, device)
            dest = torch.randperm(pool_rows, device=device)[:n]
            pool_k = torch.zeros(pool_rows, d, dtype=torch.bfloat16, device=device)
            pool_r = torch.zeros_like(pool_k)

            def run(kv=kv, z=score, w=w, c=cos, s=sin, o=pool_k, i=dest) -> torch.Tensor:  # noqa: ANN001
                rope.compress_store(kv, z, w, EPS, c, s, o, i)
                return o

            def run_ref(kv=kv, z=score, w=w, c=cos, s=sin, o=pool_r, i=dest) -> torch.Tensor:  # noqa: ANN001
                ref.compress_store(kv, z, w, EPS, c, s, o, i)
                return o

            nbytes = 2 * kv.numel() * 4 + n * d * 2 + d * 4 + 2 * cos.numel() * 4 + n * 8
            out.append(
                Case("compress", f"{name} n={n} s={slots} d={d}", run, run_ref, bytes=nbytes)
            )
    return out


def _keep_cases(
    device: str,
    dtype: torch.dtype,
    tokens: tuple[int, ...],
    kinds: tuple[tuple[str, int, int], ...],
) -> list[Case]:
    # ---- a decode step's compressor projections (kv | gate of one GEMM) into the fp32 ring
    out = []
    for name, n, ratio in kinds:
        ape = torch.randn(ratio, n, device=device)
        for T in tokens:
            y = torch.randn(T, 2 * n, device=device).to(dtype)
            kv, gate = y[:, :n], y[:, n:]
            pos = torch.randint(0, 1 << 20, (T,), device=device)
            rows = torch.randperm(max(64, 2 * T) * 8, device=device)[:T]
            ring = [torch.zeros(max(64, 2 * T) * 8, n, device=device) for _ in range(4)]

            def run(kv=kv, g=gate, a=ape, p=pos, r=rows, st=ring[:2], m=ratio) -> torch.Tensor:  # noqa: ANN001
                rope.compress_keep(kv, g, a, p, m, *st, r)
                return torch.cat(st)

            def run_ref(kv=kv, g=gate, a=ape, p=pos, r=rows, st=ring[2:], m=ratio) -> torch.Tensor:  # noqa: ANN001
                ref.compress_keep(kv, g, a, p, m, *st, r)
                return torch.cat(st)

            # kv + gate in, their ape rows, two fp32 rows out (+ positions and rows)
            nbytes = 2 * T * n * y.element_size() + T * n * 4 + 2 * T * n * 4 + T * 16
            out.append(Case("compress_keep", f"{name} T={T} n={n}", run, run_ref, bytes=nbytes))
    return out


def cases(device: str, quick: bool) -> list[Case]:
    torch.manual_seed(0)
    if quick:  # tiny shapes for the interpreter
        return (
            _rows_cases(device, torch.bfloat16, (3,), H=2, d=64, rd=16)
            + _kv_cases(device, torch.bfloat16, (3,), d=64, rd=16)
            + _qkv_cases(device, torch.bfloat16, (3,), H=2, d=64, rd=16)
            + _compress_cases(device, (2,), (("CSA", 8, 64), ("HCA", 128, 32)), 16, 50)
            + _keep_cases(device, torch.bfloat16, (3,), (("CSA", 48, 4),))
        )
    bf = torch.bfloat16
    return (
        _rows_cases(device, bf, (1, 64, 4096), H=64, d=512, rd=64)
        + _kv_cases(device, bf, (1, 64), d=512, rd=64)
        + _qkv_cases(device, bf, (1, 64), H=64, d=512, rd=64)
        + _compress_cases(
            device, (1, 16, 64), (("CSA", 8, 512), ("idx", 8, 128), ("HCA", 128, 512)), 64, 100_000
        )
        + _keep_cases(device, bf, (1, 64), (("CSA", 1024, 4), ("idx", 256, 4), ("HCA", 512, 128)))
    )
