"""Sampler.constrain at 1 / 16 / 64 constrained rows on the GPU: the constraint masks copied
from the host every step (the sampler's device cache cleared before each call) against the
cached device copies (a grammar's mask for a state is the same host tensor every step)."""

from __future__ import annotations

import time

import torch

from dsv4.sampling import Sampler

V = 129280


class Fixed:
    def __init__(self, mask: torch.Tensor) -> None:
        self.m = mask

    def mask(self, output_ids: list[int]) -> torch.Tensor:
        return self.m


def median_ms(fn, n: int = 30) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[n // 2]


def main() -> None:
    for B in (1, 16, 64):
        cons = [Fixed(torch.rand(V) > 0.5) for _ in range(B)]
        logits = torch.randn(B, V, device="cuda")
        out_ids = [[0]] * B
        s = Sampler(eos_token_id=1)

        def copied() -> None:
            s._masks.clear()
            s.constrain(logits, out_ids, cons)

        a = median_ms(copied)
        b = median_ms(lambda: s.constrain(logits, out_ids, cons))  # noqa: B023
        print(f"constrain B={B}: masks copied each step {a:.3f} ms, cached on the GPU {b:.3f} ms")


if __name__ == "__main__":
    main()
