"""A small interpreter for the inline PTX of the weight decodes (the Gluon kernels of
`dsv4.ops.moe_sm90` and `dsv4.ops.linear_sm90`, the GEMV form of `dsv4.ops.moe`): the
instructions they use, run on numpy arrays on the CPU."""

from __future__ import annotations

import numpy as np
import torch


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run_ptx(asm: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # the instructions the decodes use, on uint32 arrays (PTX ISA semantics); `regs` names the
    # inputs ($1 ...), the result holds every register written
    env = dict(regs)

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        return (
            env[tok]
            if tok in env
            else np.uint32(int(tok, 0)) + np.zeros_like(next(iter(regs.values())))
        )

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # mov.b32 {lo, hi}, src: split the halves
            halves, src = rest[1:].split("}")
            lo, hi = (h.strip() for h in halves.split(","))
            v = val(src.strip(" ,"))
            env[lo], env[hi] = (v & 0xFFFF).astype(np.uint32), (v >> 16).astype(np.uint32)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "prmt.b32":  # byte j of d = byte (selector nibble j) of {a, b}
            a, b, sel = srcs
            pool = [(a >> (8 * j)) & 0xFF for j in range(4)] + [
                (b >> (8 * j)) & 0xFF for j in range(4)
            ]
            pool = np.stack(pool)  # [8, n]
            out = np.zeros_like(a)
            for j in range(4):
                n = (sel >> (4 * j)) & 0xF
                byte = np.take_along_axis(pool, (n & 7)[None, :].astype(np.int64), 0)[0]
                byte = np.where(n & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
                out |= byte << (8 * j)
            env[d] = out
        elif op == "cvt.f32.f16":  # fp16 bits (low 16) -> fp32 bits, exact (subnormals too)
            f16 = (srcs[0] & 0xFFFF).astype(np.uint16).view(np.float16)
            env[d] = f16.astype(np.float32).view(np.uint32)
        elif op == "cvt.u32.u16":
            env[d] = srcs[0] & 0xFFFF
        elif op == "add.u32":
            env[d] = srcs[0] + srcs[1]
        elif op == "mul.lo.u32":  # the low 32 bits of the product
            env[d] = (srcs[0].astype(np.uint64) * srcs[1].astype(np.uint64)) & 0xFFFFFFFF
        elif op == "shl.b32":
            env[d] = srcs[0] << srcs[1]
        elif op == "shr.b32":
            env[d] = srcs[0] >> srcs[1]
        elif op == "and.b32":
            env[d] = srcs[0] & srcs[1]
        elif op == "or.b32":
            env[d] = srcs[0] | srcs[1]
        elif op == "mov.b32":
            env[d] = srcs[0].copy()
        elif op == "mul.rn.bf16x2":  # each half: bf16 * bf16, rounded to bf16 (here exact)
            halves = []
            for sh in (0, 16):  # inf * 0 is a NaN and overflow inf, as on the GPU
                with np.errstate(invalid="ignore", over="ignore"):
                    prod = (
                        bf16_bits_to_float((srcs[0] >> sh) & 0xFFFF)
                        * bf16_bits_to_float((srcs[1] >> sh) & 0xFFFF)
                    ).astype(np.float32)
                p = torch.from_numpy(prod).bfloat16()
                halves.append(p.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF)
            env[d] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"unknown PTX op {op!r}")
        env[d] = env[d].astype(np.uint32)
    return env
