"""The transformers reference: DeepseekV4ForCausalLM in fp32 on weights dequantized independently."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import numpy as np
import torch

from dsv4.bench.hf import hf_config  # ModelArgs -> DeepseekV4Config, shared with the bench
from dsv4.checkpoint import checkpoint_files
from dsv4.config import ModelArgs
from tests.test_quant import np_e4m3, np_e8m0, np_nibbles


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def independent_dequant(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as fp32, dequantized by hand with numpy (no dsv4.quant)."""
    from safetensors import safe_open

    files = checkpoint_files(ckpt_dir)
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(set(files.values())):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith((".scale", ".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        stem = name[: -len("weight")]
        if t.dtype == torch.float8_e4m3fn:  # FP8 128x128 blocks
            s = np_e8m0(_u8(raw[stem + "scale"]))
            s = np.repeat(np.repeat(s, 128, 0), 128, 1)[: t.shape[0], : t.shape[1]]
            out[name] = torch.from_numpy(np_e4m3(_u8(t)).astype(np.float32) * s)
        elif t.dtype == torch.int8:  # MXFP4: low nibble first, e8m0 per 32
            v = np_nibbles(_u8(t))
            s = np.repeat(np_e8m0(_u8(raw[stem + "scale"])), 32, 1)
            out[name] = torch.from_numpy((v * s).astype(np.float32))
        elif t.dtype == torch.uint8:  # NVFP4: e4m3 per 16 times fp32 global
            v = np_nibbles(_u8(t))
            s = np.repeat(np_e4m3(_u8(raw[stem + "weight_scale"])).astype(np.float32), 16, 1)
            g = raw[stem + "weight_scale_2"].float().item()
            out[name] = torch.from_numpy((v * s).astype(np.float32) * np.float32(g))
        elif t.dtype == torch.int64:
            out[name] = t
        else:
            out[name] = t.float()
    return out


# official name -> transformers name (applied in order; experts handled separately)
_RENAMES = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"(compressor|indexer)\.norm\.", r"\1.kv_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]


def hf_state_dict(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.startswith("mtp.") or ".experts." in name and "shared" not in name:
            continue
        for pat, rep in _RENAMES:
            name = re.sub(pat, rep, name)
        out[name] = t
    for i in range(args.n_layers):
        p = f"layers.{i}.ffn.experts"
        E = args.n_routed_experts
        w1 = torch.stack([weights[f"{p}.{e}.w1.weight"] for e in range(E)])
        w3 = torch.stack([weights[f"{p}.{e}.w3.weight"] for e in range(E)])
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [weights[f"{p}.{e}.w2.weight"] for e in range(E)]
        )
    return out


def hf_model(ckpt_dir: str | Path, weights: dict[str, torch.Tensor] | None = None):  # noqa: ANN201
    """The transformers model in fp32 holding the independently dequantized checkpoint."""
    from transformers import DeepseekV4ForCausalLM

    args = ModelArgs.from_json(ckpt_dir)
    weights = weights if weights is not None else independent_dequant(ckpt_dir)
    model = DeepseekV4ForCausalLM(hf_config(args)).float().eval()
    sd = hf_state_dict(weights, args)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "inv_freq" not in k]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    return model


def _stable_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: ANN202, A002
    idx = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, idx), idx))


@contextlib.contextmanager
def stable_topk():  # noqa: ANN201
    """Patch torch's top-k to the deterministic rule (ties -> lower index) for the reference."""
    orig_fn, orig_method = torch.topk, torch.Tensor.topk
    torch.topk, torch.Tensor.topk = _stable_topk, _stable_topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = orig_fn, orig_method


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with stable_topk():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """Greedy continuation with transformers' own cache (prefill, then one token at a time)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out: list[int] = []
    with stable_topk():
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        for _ in range(max_new_tokens):
            t = int(logits[0, -1].argmax())
            out.append(t)
            logits = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits
    return out
