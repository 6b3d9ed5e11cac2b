"""Typed configuration: ModelArgs (the checkpoint's config.json), EngineConfig."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.parallel import Parallel

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
HASH_MOE, MOE = "hash_moe", "moe"
WEIGHT_DTYPES = ("fp8", "bf16")
EXPERT_DTYPES = ("fp4", "nvfp4", "fp8", "bf16")


class ConfigError(ValueError):
    """A config.json that is missing a field or contradicts itself."""


@dataclass(frozen=True)
class YarnArgs:
    """YaRN scaling of the compress RoPE."""

    factor: float
    original_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelArgs:
    """DeepSeek-V4 hyper-parameters, one field per config.json key (reference names)."""

    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    layer_types: tuple[str, ...]  # per main layer: SLIDING | CSA | HCA
    mlp_layer_types: tuple[str, ...]  # per main layer: HASH_MOE | MOE
    csa_ratio: int
    hca_ratio: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    route_scale: float = 1.5
    score_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnArgs | None = None
    max_position_embeddings: int = 1048576
    n_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    weight_dtype: str = "fp8"  # dense projections: fp8 (128x128 UE8M0) | bf16
    expert_dtype: str = "fp4"  # routed experts: fp4 (MXFP4) | nvfp4 | fp8 | bf16

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.dim

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        ratio = {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        return tuple(ratio[t] for t in self.layer_types)

    @property
    def n_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    # ---- io ------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, source=str(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> ModelArgs:
        return _parse(cfg, source)

    def to_dict(self) -> dict[str, Any]:
        """Official (DeepSeek release) key style; `from_dict(to_dict())` round-trips."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "routed_scaling_factor": self.route_scale,
            "scoring_func": self.score_func,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "num_hash_layers": self.n_hash_layers,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if self.csa_ratio == 4 and self.mlp_layer_types == _hash_schedule(
            self.n_layers, self.n_hash_layers
        ):
            d["compress_ratios"] = list(self.compress_ratios) + [0] * self.n_mtp_layers
        else:  # non-standard CSA ratio or hash schedule: transformers style
            d["layer_types"] = list(self.layer_types)
            d["mlp_layer_types"] = list(self.mlp_layer_types)
            del d["num_hash_layers"]
        d["compress_rates"] = {CSA: self.csa_ratio, HCA: self.hca_ratio}
        if self.yarn is not None:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_seq_len,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        if self.weight_dtype == "fp8":
            d["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            }
        d["expert_dtype"] = self.expert_dtype
        return d

    def replace(self, **kw: Any) -> ModelArgs:
        return dataclasses.replace(self, **kw)

    def __post_init__(self) -> None:
        _validate(self)


# ---- parsing ------------------------------------------------------------------------------

# ModelArgs field <- accepted config.json keys (official HF-hub names first, reference names after)
_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "dim": ("hidden_size", "dim"),
    "moe_inter_dim": ("moe_intermediate_size", "moe_inter_dim"),
    "n_layers": ("num_hidden_layers", "n_layers"),
    "n_heads": ("num_attention_heads", "n_heads"),
    "head_dim": ("head_dim",),
    "q_lora_rank": ("q_lora_rank",),
    "o_groups": ("o_groups",),
    "o_lora_rank": ("o_lora_rank",),
    "window_size": ("sliding_window", "window_size"),
    "n_routed_experts": ("n_routed_experts",),
    "n_shared_experts": ("n_shared_experts",),
    "n_activated_experts": ("num_experts_per_tok", "n_activated_experts"),
    "index_n_heads": ("index_n_heads",),
    "index_head_dim": ("index_head_dim",),
    "index_topk": ("index_topk",),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "route_scale": ("routed_scaling_factor", "route_scale"),
    "score_func": ("scoring_func", "score_func"),
    "swiglu_limit": ("swiglu_limit",),
    "hc_mult": ("hc_mult",),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters",),
    "hc_eps": ("hc_eps",),
    "norm_eps": ("rms_norm_eps", "norm_eps"),
    "rope_theta": ("rope_theta",),
    "compress_rope_theta": ("compress_rope_theta",),
    "max_position_embeddings": ("max_position_embeddings",),
    "n_mtp_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
    "bos_token_id": ("bos_token_id",),
    "eos_token_id": ("eos_token_id",),
}
_RATIO_TO_TYPE_DEFAULT = {0: SLIDING, 4: CSA}


def _get(cfg: dict, keys: tuple[str, ...], source: str, required: bool = True) -> Any:
    found = [(k, cfg[k]) for k in keys if k in cfg]
    if len({json.dumps(v) for _, v in found}) > 1:
        raise ConfigError(f"{source}: conflicting values for {[k for k, _ in found]}: {found}")
    if found:
        return found[0][1]
    if required:
        raise ConfigError(f"{source}: missing required field '{keys[0]}'")
    return None


def _hash_schedule(n_layers: int, n_hash: int) -> tuple[str, ...]:
    return tuple([HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash))


def _parse(cfg: dict[str, Any], source: str) -> ModelArgs:
    kw: dict[str, Any] = {f: _get(cfg, keys, source) for f, keys in _KEYS.items()}
    for f, keys in _OPTIONAL.items():
        v = _get(cfg, keys, source, required=False)
        if v is not None:
            kw[f] = v
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    n = kw["n_layers"]
    if cfg.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (shared K=V head)")

    # rope head dim: qk_rope_head_dim (official) or partial_rotary_factor (transformers)
    rd = _get(cfg, ("qk_rope_head_dim", "rope_head_dim"), source, required=False)
    prf = cfg.get("partial_rotary_factor")
    if rd is None and prf is None:
        raise ConfigError(f"{source}: missing required field 'qk_rope_head_dim'")
    if prf is not None and rd is not None and round(prf * kw["head_dim"]) != rd:
        raise ConfigError(
            f"{source}: partial_rotary_factor={prf} * head_dim={kw['head_dim']} "
            f"contradicts qk_rope_head_dim={rd}"
        )
    kw["rope_head_dim"] = int(rd if rd is not None else round(prf * kw["head_dim"]))

    # compress rates
    rates = dict(cfg.get("compress_rates") or {})
    bad = set(rates) - {CSA, HCA}
    if bad:
        raise ConfigError(f"{source}: compress_rates has unknown layer types {sorted(bad)}")

    # layer schedule: compress_ratios (official, n_layers [+ MTP] entries) or layer_types (HF)
    ratios, types = cfg.get("compress_ratios"), cfg.get("layer_types")
    if ratios is None and types is None:
        raise ConfigError(f"{source}: missing required field 'compress_ratios' (or 'layer_types')")
    if ratios is not None:
        n_mtp = kw.get("n_mtp_layers", 0)
        if len(ratios) not in (n, n + n_mtp):
            raise ConfigError(
                f"{source}: compress_ratios has {len(ratios)} entries; expected num_hidden_layers="
                f"{n} or num_hidden_layers + num_nextn_predict_layers={n + n_mtp}"
            )
        if any(r != 0 for r in ratios[n:]):
            raise ConfigError(
                f"{source}: compress_ratios for MTP layers must be 0, got {ratios[n:]}"
            )
        ratios = list(ratios[:n])
        csa_r = rates.get(CSA, 4)
        hca_values = sorted({r for r in ratios if r not in (0, csa_r)})
        if len(hca_values) > 1:
            raise ConfigError(f"{source}: compress_ratios mixes HCA ratios {hca_values}")
        if any((not isinstance(r, int)) or r < 0 for r in ratios):
            raise ConfigError(
                f"{source}: compress_ratios entries must be non-negative ints: {ratios}"
            )
        hca_r = hca_values[0] if hca_values else rates.get(HCA, 128)
        if rates.get(HCA, hca_r) != hca_r:
            raise ConfigError(
                f"{source}: compress_ratios uses HCA ratio {hca_r} but compress_rates says "
                f"{rates[HCA]}"
            )
        from_ratios = tuple(SLIDING if r == 0 else CSA if r == csa_r else HCA for r in ratios)
        if types is not None and tuple(types[:n]) != from_ratios:
            raise ConfigError(f"{source}: layer_types contradicts compress_ratios")
        kw["layer_types"], kw["csa_ratio"], kw["hca_ratio"] = from_ratios, csa_r, hca_r
    else:
        if len(types) < n:
            raise ConfigError(
                f"{source}: layer_types has {len(types)} entries, num_hidden_layers={n}"
            )
        kw["layer_types"] = tuple(types[:n])
        kw["csa_ratio"], kw["hca_ratio"] = rates.get(CSA, 4), rates.get(HCA, 128)

    # MoE schedule: num_hash_layers (official) or mlp_layer_types (HF)
    n_hash, mlp_types = cfg.get("num_hash_layers"), cfg.get("mlp_layer_types")
    if mlp_types is not None:
        if len(mlp_types) < n:
            raise ConfigError(
                f"{source}: mlp_layer_types has {len(mlp_types)} entries, expected {n}"
            )
        mlp_types = tuple(mlp_types[:n])
        if n_hash is not None and mlp_types != _hash_schedule(n, n_hash):
            raise ConfigError(f"{source}: mlp_layer_types contradicts num_hash_layers={n_hash}")
        kw["mlp_layer_types"] = mlp_types
    else:
        kw["mlp_layer_types"] = _hash_schedule(n, 3 if n_hash is None else n_hash)

    # RoPE: rope_scaling (official) or rope_parameters {main, compress} (HF)
    rp = cfg.get("rope_parameters")
    yarn_cfg = cfg.get("rope_scaling")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        main, comp = rp["main"], rp.get("compress")
        if not isinstance(comp, dict):
            raise ConfigError(f"{source}: rope_parameters.compress missing")
        for label, theta_key, sub in (
            ("main", "rope_theta", main),
            ("compress", "compress_rope_theta", comp),
        ):
            if "rope_theta" in sub:
                if theta_key in cfg and cfg[theta_key] != sub["rope_theta"]:
                    raise ConfigError(
                        f"{source}: rope_parameters.{label}.rope_theta={sub['rope_theta']} "
                        f"contradicts {theta_key}={cfg[theta_key]}"
                    )
                kw[theta_key] = sub["rope_theta"]
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.main.rope_type must be 'default'")
        if comp.get("rope_type", comp.get("type", "default")) == "yarn":
            if yarn_cfg is not None:
                raise ConfigError(
                    f"{source}: both rope_scaling and rope_parameters.compress give YaRN"
                )
            yarn_cfg = comp
    elif isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) == "yarn":
        yarn_cfg = yarn_cfg or rp
    if yarn_cfg is not None:
        kind = yarn_cfg.get("type", yarn_cfg.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(f"{source}: rope_scaling.type must be 'yarn', got {kind!r}")
        if yarn_cfg.get("attention_factor", 1.0) != 1.0:
            raise ConfigError(
                f"{source}: rope_scaling.attention_factor must be 1.0 for DeepSeek-V4"
            )
        for k in ("factor", "original_max_position_embeddings"):
            if k not in yarn_cfg:
                raise ConfigError(f"{source}: rope_scaling missing required field '{k}'")
        kw["yarn"] = YarnArgs(
            factor=float(yarn_cfg["factor"]),
            original_seq_len=int(yarn_cfg["original_max_position_embeddings"]),
            beta_fast=float(yarn_cfg.get("beta_fast") or 32),
            beta_slow=float(yarn_cfg.get("beta_slow") or 1),
        )

    # weight formats
    qc = cfg.get("quantization_config")
    if qc is None:
        kw["weight_dtype"] = "bf16"
    else:
        method = qc.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"{source}: quantization_config.quant_method {method!r} unsupported (fp8)"
            )
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(
                f"{source}: quantization_config.fmt must be 'e4m3', got {qc.get('fmt')!r}"
            )
        if qc.get("scale_fmt", "ue8m0") != "ue8m0":
            raise ConfigError(
                f"{source}: quantization_config.scale_fmt must be 'ue8m0', got {qc.get('scale_fmt')!r}"
            )
        if list(qc.get("weight_block_size", [128, 128])) != [128, 128]:
            raise ConfigError(
                f"{source}: quantization_config.weight_block_size must be [128, 128], "
                f"got {qc.get('weight_block_size')}"
            )
        kw["weight_dtype"] = "fp8"
    ed = cfg.get("expert_dtype", (qc or {}).get("expert_dtype"))
    if ed is not None and (qc or {}).get("expert_dtype", ed) != ed:
        raise ConfigError(f"{source}: expert_dtype contradicts quantization_config.expert_dtype")
    kw["expert_dtype"] = ed if ed is not None else kw["weight_dtype"]
    try:
        return ModelArgs(**kw)
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None


def _validate(a: ModelArgs) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        if f.type == "int":
            need(
                isinstance(v, int) and not isinstance(v, bool),
                f"{f.name} must be an int, got {v!r}",
            )
    for name in (
        "vocab_size",
        "dim",
        "moe_inter_dim",
        "n_layers",
        "n_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "window_size",
        "n_routed_experts",
        "n_activated_experts",
        "index_n_heads",
        "index_head_dim",
        "hc_mult",
    ):
        need(getattr(a, name) > 0, f"{name} must be positive, got {getattr(a, name)}")
    need(
        len(a.layer_types) == a.n_layers,
        f"layer_types has {len(a.layer_types)} entries, num_hidden_layers={a.n_layers}",
    )
    bad = [t for t in a.layer_types if t not in (SLIDING, CSA, HCA)]
    need(not bad, f"layer_types has unknown entries {bad}")
    need(
        len(a.mlp_layer_types) == a.n_layers,
        f"mlp_layer_types has {len(a.mlp_layer_types)} entries, num_hidden_layers={a.n_layers}",
    )
    bad = [t for t in a.mlp_layer_types if t not in (HASH_MOE, MOE)]
    need(not bad, f"mlp_layer_types has unknown entries {bad}")
    need(
        a.csa_ratio > 0 and a.hca_ratio > 0,
        f"compress rates must be positive ({a.csa_ratio}, {a.hca_ratio})",
    )
    need(a.csa_ratio != a.hca_ratio, f"CSA and HCA ratios must differ (both {a.csa_ratio})")
    need(
        0 < a.rope_head_dim <= a.head_dim and a.rope_head_dim % 2 == 0,
        f"qk_rope_head_dim={a.rope_head_dim} must be even and <= head_dim={a.head_dim}",
    )
    need(
        a.rope_head_dim <= a.index_head_dim,
        f"qk_rope_head_dim={a.rope_head_dim} exceeds index_head_dim={a.index_head_dim}",
    )
    need(
        a.n_heads % a.o_groups == 0,
        f"num_attention_heads={a.n_heads} not divisible by o_groups={a.o_groups}",
    )
    need(
        a.n_activated_experts <= a.n_routed_experts,
        f"num_experts_per_tok={a.n_activated_experts} > n_routed_experts={a.n_routed_experts}",
    )
    need(a.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {a.n_shared_experts}")
    need(
        a.score_func == "sqrtsoftplus", f"scoring_func {a.score_func!r} unsupported (sqrtsoftplus)"
    )
    need(a.index_topk > 0, f"index_topk must be positive, got {a.index_topk}")
    need(a.weight_dtype in WEIGHT_DTYPES, f"weight dtype {a.weight_dtype!r} not in {WEIGHT_DTYPES}")
    need(a.expert_dtype in EXPERT_DTYPES, f"expert_dtype {a.expert_dtype!r} not in {EXPERT_DTYPES}")
    if a.weight_dtype == "fp8" or a.expert_dtype == "fp8":
        pass  # 128x128 blocks may be partial at the edges
    if a.expert_dtype in ("fp4", "nvfp4"):
        for name in ("dim", "moe_inter_dim"):
            need(
                getattr(a, name) % 32 == 0,
                f"{name}={getattr(a, name)} must be a multiple of 32 for {a.expert_dtype} experts",
            )
    need(a.n_mtp_layers >= 0, f"num_nextn_predict_layers must be >= 0, got {a.n_mtp_layers}")
    if a.yarn is not None:
        need(a.yarn.factor >= 1.0, f"rope_scaling.factor must be >= 1, got {a.yarn.factor}")
    need(
        0 <= a.bos_token_id < a.vocab_size and 0 <= a.eos_token_id < a.vocab_size,
        f"bos/eos ids ({a.bos_token_id}, {a.eos_token_id}) outside vocab {a.vocab_size}",
    )


def flash_args() -> ModelArgs:
    """The DeepSeek-V4-Flash release config (spec section 1)."""
    ratios = [0, 0] + [4, 128] * 20 + [4]
    return ModelArgs.from_dict(
        {
            "vocab_size": 129280,
            "hidden_size": 4096,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 43,
            "num_attention_heads": 64,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1024,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "sliding_window": 128,
            "compress_ratios": ratios + [0],
            "num_hash_layers": 3,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "routed_scaling_factor": 1.5,
            "scoring_func": "sqrtsoftplus",
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 512,
            "swiglu_limit": 10.0,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0,
            "num_nextn_predict_layers": 1,
            "rope_scaling": {
                "type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            },
            "expert_dtype": "fp4",
        },
        source="flash preset",
    )


KV_CACHE_DTYPES = ("auto", "fp8")
# max_seq_len "auto" (vLLM's --max-model-len auto): the longest sequence the state budget's pages
# hold, at most the model's max_position_embeddings (resolved once the weights are loaded)
AUTO_SEQ_LEN = -1
# vLLM's --scheduling-policy, and SGLang's order under --enable-priority-scheduling (higher values
# first unless --schedule-low-priority-values-first): `dsv4.scheduler`
SCHEDULING_POLICIES = ("fcfs", "priority", "priority-high-first")


def check_sizes(**sizes: int | None) -> None:
    """The engine's sizes (max_seqs, max_seq_len, chunk_size, max_step_tokens, ...) are >= 1;
    max_seq_len may be AUTO_SEQ_LEN, None leaves one unchecked. ConfigError naming them all."""
    bad = [
        k for k, v in sizes.items()
        if v is not None and v < 1 and not (k == "max_seq_len" and v == AUTO_SEQ_LEN)
    ]  # fmt: skip
    if bad:
        given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v is not None)
        raise ConfigError(f"{given}: {', '.join(bad)} must be >= 1")


def check_memory_flags(
    max_memory: int | None,
    memory_fraction: float | None,
    gpu_memory_utilization: float | None,
    max_total_tokens: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    """The state's budget comes from one of max_memory, memory_fraction, gpu_memory_utilization
    (fractions in (0, 1]); max_total_tokens, a cap on its pages' tokens, is > 0; max_seq_len
    AUTO_SEQ_LEN needs one of them. ConfigError naming what is wrong."""
    if max_total_tokens is not None and max_total_tokens <= 0:
        raise ConfigError(f"max_total_tokens must be > 0, got {max_total_tokens}")
    given = {
        "max_memory": max_memory,
        "memory_fraction": memory_fraction,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ConfigError(f"give one state budget, not {' and '.join(given)}")
    for name in ("memory_fraction", "gpu_memory_utilization"):
        if name in given and not 0 < given[name] <= 1:
            raise ConfigError(f"{name} must be in (0, 1], got {given[name]}")
    if "max_memory" in given and given["max_memory"] <= 0:
        raise ConfigError(f"max_memory must be > 0, got {max_memory}")
    if max_seq_len == AUTO_SEQ_LEN and not given and max_total_tokens is None:
        raise ConfigError(
            "max_seq_len auto (--max-model-len auto) is the longest sequence the state's budget "
            "holds: give gpu_memory_utilization, memory_fraction, max_memory or max_total_tokens"
        )


def check_policy(policy: str, preemption_threshold: int | None = None) -> None:
    """A scheduling policy is one of SCHEDULING_POLICIES; a priority preemption threshold (SGLang's
    --priority-scheduling-preemption-threshold: a waiting request preempts running ones whose
    priority it beats by more than this) is >= 0 and needs a priority policy. ConfigError naming
    what is wrong."""
    if policy not in SCHEDULING_POLICIES:
        raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    if preemption_threshold is None:
        return
    if preemption_threshold < 0:
        raise ConfigError(f"priority_preemption_threshold must be >= 0, got {preemption_threshold}")
    if policy == "fcfs":
        raise ConfigError(
            "priority_preemption_threshold needs a priority scheduling policy (--scheduling-policy "
            "priority, or SGLang's --enable-priority-scheduling)"
        )


AUTO_FLAGS = ("device", "dtype", "ops", "quantized", "cuda_graphs")  # what resolve_engine fills


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the CPU tests pin it False: tests/conftest.py)."""
    import torch

    return torch.cuda.is_available()


def resolve_engine(
    device: str = "auto",
    dtype: str = "auto",
    ops: str = "auto",
    quantized: bool | None = None,
    cuda_graphs: bool | None = None,
) -> dict[str, Any]:
    """The engine flags with "auto" / None filled in, as a vLLM or SGLang user expects.

    On a CUDA device (device "auto" takes one when torch sees it) the fast path: bfloat16, the
    Triton kernels, FP8/FP4 weights kept packed, decode steps replayed as CUDA graphs. On the CPU
    the exact reference path: float32, the torch ops, dequantized weights, eager steps. A flag
    given explicitly is kept; CUDA graphs default on only where `EngineConfig` allows them.
    """
    import torch

    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e})") from e
    if kind == "cuda" and not cuda_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device")
    gpu = kind == "cuda"
    if dtype == "auto":
        dtype = "bfloat16" if gpu else "float32"
    if ops == "auto":
        ops = "triton" if gpu else "ref"
    if quantized is None:
        quantized = gpu
    if cuda_graphs is None:
        cuda_graphs = gpu and ops == "triton" and quantized
    return dict(zip(AUTO_FLAGS, (device, dtype, ops, quantized, cuda_graphs)))


@dataclass(frozen=True)
class EngineConfig:
    """How the model runs: device, compute dtype, op backend, state limits."""

    device: str = "cpu"
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    ops: str = "ref"  # "ref" (torch) | "triton"
    quantized: bool = False  # keep FP8/FP4 weights packed in memory (dequantize inside ops)
    max_seqs: int = 8
    max_seq_len: int = 4096
    cuda_graphs: bool = False  # replay decode steps as CUDA graphs (cuda, ops="triton", quantized)
    # attention state (window rings, compressed entries): "auto" = the compute dtype; "fp8" = 584-byte
    # FP8 entries at Flash width (e4m3 nope + bf16 rope + UE8M0 scales, `dsv4.quant.kv_entry_layout`)
    kv_cache_dtype: str = "auto"
    parallel: Parallel = field(default_factory=Parallel)  # tensor/expert-parallel rank and size
    num_speculative_tokens: int = 0  # MTP speculative decoding: draft tokens per step (0 = off)
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES (`dsv4.scheduler`)
    # a waiting request preempts running ones it beats by more than this priority (None: never)
    priority_preemption_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.ops not in ("ref", "triton"):
            raise ConfigError(f"ops must be 'ref' or 'triton', got {self.ops!r}")
        if self.cuda_graphs and not (
            self.ops == "triton" and self.device.startswith("cuda") and self.quantized
        ):
            raise ConfigError(
                "cuda_graphs needs a CUDA device, ops='triton' and quantized=True (the torch "
                "reference ops, and the routed experts once dequantized, wait on the device "
                f"inside the step); got device={self.device!r}, ops={self.ops!r}, "
                f"quantized={self.quantized}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        check_policy(self.scheduling_policy, self.priority_preemption_threshold)
        check_sizes(max_seqs=self.max_seqs, max_seq_len=self.max_seq_len)

    @property
    def torch_dtype(self):  # noqa: ANN201 - torch imported lazily
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


def yarn_inv_freq(rope_dim: int, theta: float, yarn: YarnArgs | None):  # -> fp32 [rope_dim//2]
    """Per-pair inverse frequencies (spec 3.2), as python floats computed like transformers."""
    import torch

    base = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    inv = 1.0 / base
    if yarn is None or yarn.factor <= 1.0:
        return inv

    def corr(rot: float) -> float:
        return (
            rope_dim * math.log(yarn.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (yarn.factor * base)) * (1 - extrap) + inv * extrap
    return inv


def speculative_tokens(config: dict | str | None) -> int:
    """Draft tokens per step from a vLLM-style speculative config (a dict or its JSON text):
    {"method": "mtp", "num_speculative_tokens": k}; None = no speculative decoding. The model's
    MTP layer drafts; k > 1 feeds it its own output for each further token, as vLLM does."""
    if config is None:
        return 0
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"speculative config must be a JSON object, got {config!r}")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ConfigError(f"speculative config: unknown keys {unknown}")
    method = config.get("method", "mtp")
    if method not in ("mtp", "deepseek_mtp"):
        raise ConfigError(
            f"speculative config: method must be 'mtp' (the model's MTP layer), got {method!r}"
        )
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
        raise ConfigError(
            f"speculative config: num_speculative_tokens must be an int in [1, 8], got {k!r}"
        )
    return k


@dataclass(frozen=True)
class ServerConfig:
    """`dsv4 serve` settings: where to listen, who may call, and the engine to build."""

    model: str | None = None  # checkpoint directory; None = the built-in demo model
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer key required on /v1/*; None = open
    served_model_name: str | None = None  # the `model` clients send; default: directory name
    max_queue: int | None = None  # waiting requests past which new ones get 503; None = no cap
    max_body_bytes: int = 32 << 20  # larger request bodies get 413
    device: str = "auto"  # the engine flags: "auto" / None as `resolve_engine` fills them in
    dtype: str = "auto"
    quantized: bool | None = None
    ops: str = "auto"
    max_seq_len: int = 4096
    max_seqs: int = 8
    chunk_size: int | None = None  # one sequence's prefill chunk; None = max_step_tokens
    max_step_tokens: int = 2048  # tokens one engine step runs (vLLM's max_num_batched_tokens)
    block_size: int | None = None  # tokens a state page covers; None = the model's default
    max_memory: int | None = None
    max_total_tokens: int | None = None  # SGLang's: a cap on the state's page tokens
    memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None  # vLLM's / SGLang's (--mem-fraction-static)
    cuda_graphs: bool | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each); rank 0 serves HTTP
    # vLLM's --speculative-config: {"method": "mtp", "num_speculative_tokens": k} (JSON text)
    speculative_config: str | None = None
    enable_prefix_caching: bool = True  # vLLM's flag, on by default as there (`dsv4.prefix_cache`)
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES (`dsv4.scheduler`)
    # a waiting request preempts running ones it beats by more than this priority (None: never)
    priority_preemption_threshold: int | None = None
    prefix_snapshots: int | None = None  # ring snapshots kept; None = 4 per max_seqs
    enable_layerwise_nvtx_marker: bool = False  # SGLang's: NVTX ranges a layer (`dsv4.nvtx`)
    warmup: bool = True  # on a GPU, compile and capture before serving (`LLM.warmup`)
    disable_log_stats: bool = False  # vLLM's flag: no periodic engine line (`StatsLogger`)
    profile_dir: str | None = None  # where /start_profile writes traces unless it names one
    # vLLM's --generation-config: "auto" (the checkpoint's generation_config.json gives the
    # sampling defaults), "vllm" (the OpenAI defaults only) or a directory holding one
    generation_config: str = "auto"
    # vLLM's / SGLang's (--random-seed) global seed: the draws of requests without a seed of
    # their own start from it (rank 0 draws); None: unseeded
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must be non-empty when given")
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("served_model_name must be non-empty when given")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if (
            self.generation_config not in ("auto", "vllm")
            and not Path(self.generation_config).is_dir()
        ):
            raise ConfigError(
                f"generation_config must be auto, vllm or a directory, got "
                f"{self.generation_config!r}"
            )
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        check_sizes(
            max_seqs=self.max_seqs, max_seq_len=self.max_seq_len, chunk_size=self.chunk_size,
            max_step_tokens=self.max_step_tokens,
        )  # fmt: skip
        check_memory_flags(
            self.max_memory, self.memory_fraction, self.gpu_memory_utilization,
            self.max_total_tokens, self.max_seq_len,
        )  # fmt: skip
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        speculative_tokens(self.speculative_config)  # a bad one fails before the server starts
        check_policy(self.scheduling_policy, self.priority_preemption_threshold)

    @property
    def model_name(self) -> str:
        if self.served_model_name is not None:
            return self.served_model_name
        return Path(self.model).name if self.model is not None else "dsv4-demo"
