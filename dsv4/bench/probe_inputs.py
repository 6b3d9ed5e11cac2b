"""Flash-shaped inputs shared by the GPU probe scripts in bench/ (kernel_times, probe_pieces):
one decode token's hc_pre parameters and the 640-key sparse-attention decode case."""

from __future__ import annotations

import torch

H, D = 64, 512  # attention heads and K=V width
WINDOW, SELECTED = 128, 512  # ring rows and compressed rows a decode token attends


def hc_pre_params(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash's hc_pre parameters on the GPU: fn [24, 4*4096] fp32, scale [3], base [24]."""
    fn = torch.randn(24, 16384, device="cuda", generator=g) * 0.01
    return (
        fn,
        torch.rand(3, device="cuda", generator=g),
        torch.randn(24, device="cuda", generator=g),
    )


class AttnDecode:
    """A 128-row window ring, a 1M-row compressed pool and the sinks; `tokens(T)` gives T decode
    tokens, each over the whole ring and 512 random pool rows: (q, kv sources, sink, idx)."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g
        self.pool = torch.randn(1 << 20, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.ring = torch.randn(WINDOW, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.sink = torch.randn(H, device="cuda", generator=g)

    def tokens(
        self, T: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        g = self.g
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        # rows of the concatenation ring | new | pool: the pool starts at WINDOW + T
        sel = (
            WINDOW
            + T
            + torch.randint(0, self.pool.shape[0], (T, SELECTED), device="cuda", generator=g)
        )
        idx = torch.cat([torch.arange(WINDOW, device="cuda").expand(T, WINDOW), sel], 1)
        return q, (self.ring, new, self.pool), self.sink, idx
