"""NVTX ranges for Nsight Systems (SGLang's --enable-layerwise-nvtx-marker): the embedding, each
layer, its attention and its feed-forward (MoE), and the MTP layers', named by their parameter
prefixes (`layers.3.attn`), so `nsys profile` timelines read by layer. Forward hooks put them on
the modules from outside the model code; off by default (no hooks, no cost). Under CUDA graphs a
replay runs no Python: the ranges then show the eager and capture passes only
(`nsys profile --cuda-graph-trace=node` shows the replays' kernels)."""

from __future__ import annotations

import re

import torch

MARKED = re.compile(r"^(embed|(layers|mtp)\.\d+(\.(attn|ffn))?)$")


def mark_layers(model: torch.nn.Module) -> list:
    """Hook an NVTX range around every marked module's forward; returns the hooks' handles
    (`.remove()` takes them off)."""
    handles = []
    for name, module in model.named_modules():
        if MARKED.match(name):
            handles.append(module.register_forward_pre_hook(_push(name)))
            handles.append(module.register_forward_hook(_pop))
    return handles


def _push(name: str):  # noqa: ANN202
    def hook(module, args) -> None:  # noqa: ANN001
        torch.cuda.nvtx.range_push(name)

    return hook


def _pop(module, args, output) -> None:  # noqa: ANN001
    torch.cuda.nvtx.range_pop()
