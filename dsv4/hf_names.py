"""Transformers' DeepseekV4 parameter names -> the checkpoint's (DeepSeek's native) names, for
weight updates from a trainer that holds the transformers model (`LLM.update_weights_from_tensor`
takes either). The renames are those of transformers' conversion mapping
(../shared/spec/dsv4-model.md §10.4) read backwards; the routed experts, stacked there
(`experts.gate_up_proj` [E, 2I, H] = w1 | w3, `experts.down_proj` [E, H, I] = w2), come back
one tensor per expert. FP8 weights kept by transformers' quantizer carry `weight_scale_inv`,
the checkpoint's `scale`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# one path segment -> the checkpoint's (shared experts' projections: below)
SEGMENTS = {
    "self_attn": "attn",
    "mlp": "ffn",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "gate_proj": "wgate",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "q_a_norm": "q_norm",
    "sinks": "attn_sink",
    "position_bias": "ape",
    "e_score_correction_bias": "bias",
    "weight_scale_inv": "scale",
}
SHARED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_hf(name: str) -> bool:
    """A transformers name (every one starts so; no checkpoint name does)."""
    return name.startswith(("model.", "lm_head."))


def native_name(name: str) -> str:
    """The checkpoint's name of transformers' parameter `name` (not a stacked expert tensor);
    an unknown name comes back renamed as far as the rules go (the loader then names it)."""
    if name == "lm_head.weight":
        return "head.weight"
    n = name.removeprefix("model.")
    if n == "embed_tokens.weight":
        return "embed.weight"
    if m := re.fullmatch(r"hc_head\.hc_(fn|base|scale)", n):
        return f"hc_head_{m[1]}"
    n = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", n)
    # the indexer lives inside the compressor there: its own projections, and its compressor's
    n = n.replace(".compressor.indexer.scorer.weights_proj.", ".indexer.weights_proj.")
    n = n.replace(".compressor.indexer.q_b_proj.", ".indexer.wq_b.")
    n = n.replace(".compressor.indexer.", ".indexer.compressor.")
    n = n.replace(".compressor.kv_norm.", ".compressor.norm.")  # (attention's stays kv_norm)
    parts = n.split(".")
    shared = "shared_experts" in parts
    return ".".join(SHARED[p] if shared and p in SHARED else SEGMENTS.get(p, p) for p in parts)


def native(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with transformers' names turned into the checkpoint's (others pass
    as they are); the stacked routed experts split into one w1 / w3 / w2 per expert."""
    for name, t in named:
        if not is_hf(name):
            yield name, t
            continue
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name):
            stem = f"layers.{m[1]}.ffn.experts"
            if t.dim() != 3 or (m[2] == "gate_up_proj" and t.shape[1] % 2):
                raise ValueError(f"tensor {name}: [experts, rows, columns] expected, given "
                                 f"{list(t.shape)}")  # fmt: skip
            for e in range(t.shape[0]):
                if m[2] == "gate_up_proj":
                    w1, w3 = t[e].chunk(2)
                    yield f"{stem}.{e}.w1.weight", w1
                    yield f"{stem}.{e}.w3.weight", w3
                else:
                    yield f"{stem}.{e}.w2.weight", t[e]
            continue
        yield native_name(name), t
