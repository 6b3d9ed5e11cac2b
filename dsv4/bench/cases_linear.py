"""FP8 dense-projection cases: Flash's attention projections (wq_a, wq_b, wkv, the grouped wo_a,
wo_b) and the shared expert's w1 at decode batches T = 1, 16, 64; quick = tiny CPU shapes."""

from __future__ import annotations

import torch

from dsv4.bench.ops import Case
from dsv4.ops import linear, ref

FLASH = (  # name, out, in, groups
    ("wq_a", 1024, 4096, 1),
    ("wq_b", 32768, 1024, 1),
    ("wkv", 512, 4096, 1),
    ("wo_a", 8192, 4096, 8),
    ("wo_b", 4096, 8192, 1),
    ("shared w1", 2048, 4096, 1),
)


def _fp8_weight(N: int, K: int, device: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    # random e4m3 bytes (NaN codes 0x7f / 0xff cleared) and e8m0 scales 2^-8..2^-6
    b = torch.randint(0, 256, (N, K), generator=g, device=device, dtype=torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)
    s = torch.randint(119, 122, (-(-N // 128), -(-K // 128)), generator=g, device=device)
    return b.view(torch.float8_e4m3fn), s.to(torch.uint8).view(torch.float8_e8m0fnu)


def cases(device: str, quick: bool) -> list[Case]:
    shapes = (("w", 256, 256, 1), ("w grouped", 256, 128, 2)) if quick else FLASH
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if quick else torch.bfloat16
    out: list[Case] = []
    for name, N, K, G in shapes:
        w, s = _fp8_weight(N, K, device, g)
        for T in (1, 5) if quick else (1, 16, 64):
            x = torch.randn(T, G, K, generator=g, device=device).to(dtype)
            # read the fp8 weight + scales and x ; write y
            nbytes = w.numel() + s.numel() + (x.numel() + T * N) * x.element_size()
            if G == 1:
                run = lambda x=x[:, 0], w=w, s=s: linear.linear(x, w, "fp8", s)  # noqa: E731
                want = lambda x=x[:, 0], w=w, s=s: ref.linear(x, w, "fp8", s)  # noqa: E731
            else:
                run = lambda x=x, w=w, s=s: linear.grouped_linear(x, w, "fp8", s)  # noqa: E731
                want = lambda x=x, w=w, s=s: ref.grouped_linear(x, w, "fp8", s)  # noqa: E731
            out.append(Case("linear", f"{name} T={T} [{N},{K}]", run=run, ref=want, bytes=nbytes))
    return out
