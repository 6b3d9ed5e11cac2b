"""transformers' DeepseekV4ForCausalLM (eager attention) at the same width and layers, for `--hf`.

It gets its own random init (transformers' `_init_weights`, bf16 dense weights; hash tables copied
from our model so hash layers route like ours). Its cache reaches context L without prefilling L
tokens: prefill P = L mod lcm(ratios) + k*lcm >= window tokens, then grow the compressed-entry
lists to L // ratio random entries and advance every layer's token count to L.
"""

from __future__ import annotations

import math

import torch

from dsv4.bench.timing import Clock, measure, with_projection
from dsv4.config import CSA, HCA, ModelArgs
from dsv4.model import Transformer


def hf_config(args: ModelArgs):  # noqa: ANN201  (transformers imported lazily)
    """ModelArgs -> transformers' DeepseekV4Config (the tests build their reference with it too)."""
    from transformers import DeepseekV4Config

    rope = None
    if args.yarn is not None:
        rope = {
            "rope_type": "yarn",
            "factor": args.yarn.factor,
            "original_max_position_embeddings": args.yarn.original_seq_len,
            "beta_fast": args.yarn.beta_fast,
            "beta_slow": args.yarn.beta_slow,
        }
    cfg = DeepseekV4Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        moe_intermediate_size=args.moe_inter_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=1,
        head_dim=args.head_dim,
        q_lora_rank=args.q_lora_rank,
        partial_rotary_factor=args.rope_head_dim / args.head_dim,
        num_experts_per_tok=args.n_activated_experts,
        n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts,
        routed_scaling_factor=args.route_scale,
        layer_types=list(args.layer_types),
        mlp_layer_types=list(args.mlp_layer_types),
        compress_rates={CSA: args.csa_ratio, HCA: args.hca_ratio},
        compress_rope_theta=args.compress_rope_theta,
        rope_theta=args.rope_theta,
        hc_mult=args.hc_mult,
        hc_sinkhorn_iters=args.hc_sinkhorn_iters,
        hc_eps=args.hc_eps,
        swiglu_limit=args.swiglu_limit,
        sliding_window=args.window_size,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        index_n_heads=args.index_n_heads,
        index_head_dim=args.index_head_dim,
        index_topk=args.index_topk,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters=rope,
        bos_token_id=args.bos_token_id,
        eos_token_id=args.eos_token_id,
    )
    cfg._attn_implementation = "eager"
    return cfg


def build_hf(  # noqa: ANN201
    args: ModelArgs, dtype: torch.dtype, device: torch.device, ours: Transformer
):
    """The transformers model on `device`, its own random init in `dtype`."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(hf_config(args), dtype=dtype)
    model.eval().requires_grad_(False)
    for i, layer in enumerate(model.model.layers):  # hash layers: transformers inits tid2eid to 0
        table = getattr(layer.mlp.gate, "tid2eid", None)
        if table is not None:
            table.copy_(ours.layers[i].ffn.gate.tid2eid)
    return model


def _entries(args: ModelArgs, kind: str, context: int) -> int:
    """Compressed entries a layer of `kind` holds at `context` tokens."""
    if kind == CSA:
        return context // args.csa_ratio
    return context // args.hca_ratio if kind == HCA else 0


def decode_bytes(args: ModelArgs, batch: int, context: int, elt: int) -> int:
    """Largest transient of one transformers decode step (bytes): eager attention expands the single
    K=V head to all heads over window + every compressed entry (CSA too: top-k is only a mask)."""
    worst = 0
    for kind in set(args.layer_types):
        c = _entries(args, kind, context)
        attn = batch * args.n_heads * (args.window_size + c) * (args.head_dim * elt + 16)
        idx = batch * args.index_n_heads * c * 12 if kind == CSA else 0  # fp32 indexer scores
        worst = max(worst, attn + idx)  # attn: repeat_kv copy + logits/probs
    held = sum(  # compressed lists held by the cache; growing one by torch.cat copies it
        _entries(args, k, context) * (args.head_dim + (args.index_head_dim if k == CSA else 0))
        for k in args.layer_types
    )
    return worst + 2 * batch * held * elt


def feasible_context(args: ModelArgs, batch: int, context: int, elt: int, budget: float) -> int:
    """`context`, halved until the transient fits `budget` bytes (down to one lcm of the ratios)."""
    lcm = math.lcm(args.csa_ratio, args.hca_ratio)
    while context > lcm and decode_bytes(args, batch, context, elt) > budget:
        context = max(lcm, context // 2 // lcm * lcm)
    return context


@torch.inference_mode()
def cache_at(  # noqa: ANN201
    model,  # noqa: ANN001
    args: ModelArgs,
    batch: int,
    context: int,
    g: torch.Generator,
):
    """A transformers cache holding `batch` sequences of `context` tokens -> (cache, prefilled)."""
    from transformers import DynamicCache

    device = model.lm_head.weight.device
    lcm = math.lcm(args.csa_ratio, args.hca_ratio)
    prefill = context % lcm + lcm * max(1, -(-(args.window_size - context % lcm) // lcm))
    prefill = min(prefill, context)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, args.vocab_size, (batch, prefill), device=device, generator=g)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    grow = context - prefill
    if grow:
        for i, layer in enumerate(cache.layers):
            if not hasattr(layer, "cumulative_length"):
                raise RuntimeError(
                    f"transformers cache layer {i} ({type(layer).__name__}) has no "
                    "cumulative_length: cannot grow it to the benchmark context"
                )
            layer.cumulative_length += grow
            lists = getattr(layer, "compressed_kv", None)
            if args.layer_types[i] == HCA or args.layer_types[i] == CSA:
                if not lists or any(t is None for t in lists.values()):
                    raise RuntimeError(
                        f"transformers cache layer {i} ({type(layer).__name__}) has no "
                        "compressed_kv lists to grow"
                    )
                for name, t in lists.items():
                    n = context // layer.compress_rate
                    extra = torch.randn(
                        t.shape[0],
                        n - t.shape[1],
                        t.shape[2],
                        device=device,
                        dtype=t.dtype,
                        generator=g,
                    )
                    lists[name] = torch.cat([extra, t], dim=1)
                    layer.entry_count[name] = n
    if cache.get_seq_length() != context:
        raise RuntimeError(f"transformers cache at {cache.get_seq_length()} tokens, not {context}")
    return cache, prefill


def time_decode(
    hf,  # noqa: ANN001
    args: ModelArgs,
    keys: list[str],
    counts: dict | None,
    batch: int,
    context: int,
    *,
    warmup: int,
    repeat: int,
    max_gb: float,
    seed: int,
) -> dict:
    """Decode step of `batch` sequences at `context` (or the largest context under `max_gb`),
    timed per layer like ours and projected with the same counts."""
    device = hf.lm_head.weight.device
    ctx = feasible_context(args, batch, context, hf.lm_head.weight.element_size(), max_gb * 1e9)
    g = torch.Generator(device=device).manual_seed(seed)
    cache, prefilled = cache_at(hf, args, batch, ctx, g)
    ids = torch.randint(0, args.vocab_size, (batch, 1), device=device, generator=g)
    clock = Clock(device, hf.model.layers)

    def step(j: int) -> None:
        clock.mark("start")
        hf(input_ids=ids, past_key_values=cache, use_cache=True)
        clock.mark("end")

    try:
        t = measure(step, clock, keys, warmup, repeat, 1)
    finally:
        clock.close()
        cache = None  # free it before the next run
    t = with_projection(t, counts, batch)
    note = (
        f"context {ctx}: the transient at {context} would exceed --hf-max-gb={max_gb:g}"
        if ctx != context
        else None
    )
    return t | {
        "context": ctx,
        "prefilled": prefilled,
        "note": note,
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
    }
