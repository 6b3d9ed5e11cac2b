"""Random weights in the release formats and a random decode state, made on the device.

Packed weights get random bytes with power-of-two UE8M0 scales chosen so each projection maps a
unit-RMS input to an O(1) output: FP8 bytes keep the exponent field in 5..8 (|v| in 0.25..3.75,
never the 0x7f/0xff NaN codes), MXFP4 bytes are uniform over all 16 e2m1 codes (no NaN exists).
Only the timing is meant to be realistic; the values just have to stay finite through the layers.
"""

from __future__ import annotations

import math

import torch

from dsv4.model import Linear, Transformer
from dsv4.quant import E2M1_VALUES, KV_QUANT_ROWS, quant_index_keys, quant_kv_entries
from dsv4.state import DecodeState

# RMS of one random value: FP8 e4m3 with exponent field 5..8, any sign/mantissa; e2m1 any code
_FP8_RMS = math.sqrt(
    sum((2.0 ** (e - 7) * (1 + m / 8)) ** 2 for e in range(5, 9) for m in range(8)) / 32
)
_FP4_RMS = float(E2M1_VALUES.square().mean().sqrt())


def _e8m0_exponent(value_rms: float, fan_in: int) -> int:
    """Power-of-two scale 2^e making fan_in random values of `value_rms` sum to O(1)."""
    return -round(math.log2(value_rms * math.sqrt(fan_in)))


def _fill_e8m0_(scale: torch.Tensor, exponent: int) -> None:
    scale.view(torch.uint8).fill_(127 + exponent)


def _fill_linear_(lin: Linear, g: torch.Generator) -> None:
    w = lin.weight
    if lin.fmt == "dense":
        w.normal_(0.0, w.shape[1] ** -0.5, generator=g)
    elif lin.fmt == "fp8":
        # bits: sign | exponent 5..8 | mantissa ; e4m3 NaN needs exponent 15 and mantissa 7
        r = torch.randint(0, 256, w.shape, dtype=torch.uint8, device=w.device, generator=g)
        w.view(torch.uint8).copy_((r & 0x87) | ((((r >> 3) & 0x3) + 5) << 3))
        _fill_e8m0_(lin.scale, _e8m0_exponent(_FP8_RMS, w.shape[1]))
    elif lin.fmt == "fp4":
        r = torch.randint(0, 256, w.shape, dtype=torch.uint8, device=w.device, generator=g)
        w.view(torch.uint8).copy_(r)
        _fill_e8m0_(lin.scale, _e8m0_exponent(_FP4_RMS, 2 * w.shape[1]))
    else:
        raise ValueError(f"random init supports dense/fp8/fp4 weights, not {lin.fmt!r}")


def _fill_param_(name: str, p: torch.Tensor, n_experts: int, g: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # k distinct valid expert ids per token
        scores = torch.rand(p.shape[0], n_experts, device=p.device, generator=g)
        p.copy_(scores.argsort(-1)[:, : p.shape[1]])
    elif name.endswith("gate.bias"):
        p.zero_()
    elif leaf.endswith("_fn"):  # mHC mixes: O(0.5) logits from the normalised streams
        p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=g)
    elif leaf.endswith("_base"):
        p.normal_(0.0, 0.5, generator=g)
    elif leaf.startswith("hc_") and leaf.endswith("_scale"):
        p.normal_(1.0, 0.2, generator=g)
    elif leaf == "attn_sink":
        p.normal_(0.0, 1.0, generator=g)
    elif leaf == "ape":
        p.normal_(0.0, 0.5, generator=g)
    elif p.dim() == 1 and "norm" in name:
        p.normal_(1.0, 0.1, generator=g)
    elif name == "embed.weight":
        p.normal_(0.0, 1.0, generator=g)
    elif p.dim() == 2 and p.is_floating_point():  # router weight [E, dim]
        p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    else:
        raise ValueError(f"no random-init rule for parameter {name} {tuple(p.shape)} {p.dtype}")


@torch.no_grad()
def init_random_(model: Transformer, seed: int = 0) -> None:
    """Fill every parameter of `model` in place, on its own device."""
    device = model.embed.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    done: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, Linear):
            _fill_linear_(mod, g)
            done.update(id(p) for p in mod.parameters(recurse=False))
    for name, p in model.named_parameters():
        if id(p) not in done:
            _fill_param_(name, p, model.args.n_routed_experts, g)
    model.join_projections()


@torch.no_grad()
def fill_state_(state: DecodeState, seed: int = 0) -> None:
    """Random window rings, compressed/indexer pools and compressor partial states (unit RMS, like
    the normed entries and raw projections they stand for)."""
    g = torch.Generator(device=state.block_table.device).manual_seed(seed)
    for ls in state.layers:
        _fill_rows_(ls.window, state, g)
        for c in (ls.compressor, ls.indexer):
            if c is not None:
                _fill_rows_(c.kv_cache, state, g, c.kv_scale)
                for t in (c.kv_state, c.score_state):
                    t.normal_(generator=g)


def _fill_rows_(
    rows: torch.Tensor, state: DecodeState, g: torch.Generator, scale: torch.Tensor | None = None
) -> None:
    # unit-normal K=V rows, or (uint8) FP8 entries of such rows, or with `scale` FP8 indexer keys
    # (codes in rows), a slab of rows at a time
    if rows.dtype != torch.uint8:
        rows.normal_(generator=g)
        return
    a = state.args
    for i in range(0, rows.shape[0], KV_QUANT_ROWS):
        part = rows[i : i + KV_QUANT_ROWS]
        width = part.shape[1] if scale is not None else a.head_dim
        x = torch.randn(part.shape[0], width, generator=g, device=rows.device)
        if scale is not None:
            codes, scale[i : i + part.shape[0]] = quant_index_keys(x)
            part.copy_(codes)
        else:
            part.copy_(quant_kv_entries(x, a.rope_head_dim))
