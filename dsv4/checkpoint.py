"""Official-layout checkpoints: the expected tensor table, a streaming strict loader, a sharded writer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4 import quant
from dsv4.config import CSA, HASH_MOE, SLIDING, ModelArgs

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# tensors that travel with a quantized `.weight`, per format (NVFP4 follows NVIDIA ModelOpt names)
SCALE_SUFFIXES = {
    "fp8": ("scale",),
    "fp4": ("scale",),
    "nvfp4": ("weight_scale", "weight_scale_2", "input_scale"),
}


class CheckpointError(ValueError):
    """A checkpoint that does not match what its config implies."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: str = "dense"  # for `.weight` of a quantized linear: fp8 | fp4 | nvfp4


# ---- the table -------------------------------------------------------------------------------


def _linear(out: dict, name: str, n_out: int, n_in: int, fmt: str) -> None:
    """Tensors of one linear layer `name` ([out, in]) stored in `fmt` (fp8 | fp4 | nvfp4 | bf16)."""
    if fmt == "bf16":
        out[f"{name}.weight"] = TensorSpec((n_out, n_in), torch.bfloat16)
    elif fmt == "fp8":
        out[f"{name}.weight"] = TensorSpec((n_out, n_in), torch.float8_e4m3fn, "fp8")
        out[f"{name}.scale"] = TensorSpec(quant.fp8_scale_shape(n_out, n_in), torch.float8_e8m0fnu)
    elif fmt == "fp4":
        out[f"{name}.weight"] = TensorSpec((n_out, n_in // 2), torch.int8, "fp4")
        out[f"{name}.scale"] = TensorSpec((n_out, n_in // 32), torch.float8_e8m0fnu)
    elif fmt == "nvfp4":
        out[f"{name}.weight"] = TensorSpec((n_out, n_in // 2), torch.uint8, "nvfp4")
        out[f"{name}.weight_scale"] = TensorSpec((n_out, n_in // 16), torch.float8_e4m3fn)
        out[f"{name}.weight_scale_2"] = TensorSpec((), torch.float32)
        out[f"{name}.input_scale"] = TensorSpec((), torch.float32)
    else:
        raise ValueError(f"unknown weight format {fmt!r}")


def _block(out: dict, p: str, a: ModelArgs, kind: str, hash_moe: bool) -> None:
    D, hd, F32, BF16 = a.dim, a.head_dim, torch.float32, torch.bfloat16
    w, mix = a.weight_dtype, (2 + a.hc_mult) * a.hc_mult
    for site in ("attn", "ffn"):
        out[f"{p}.{site}_norm.weight"] = TensorSpec((D,), BF16)
        out[f"{p}.hc_{site}_fn"] = TensorSpec((mix, a.hc_dim), F32)
        out[f"{p}.hc_{site}_base"] = TensorSpec((mix,), F32)
        out[f"{p}.hc_{site}_scale"] = TensorSpec((3,), F32)
    _linear(out, f"{p}.attn.wq_a", a.q_lora_rank, D, w)
    out[f"{p}.attn.q_norm.weight"] = TensorSpec((a.q_lora_rank,), BF16)
    _linear(out, f"{p}.attn.wq_b", a.n_heads * hd, a.q_lora_rank, w)
    _linear(out, f"{p}.attn.wkv", hd, D, w)
    out[f"{p}.attn.kv_norm.weight"] = TensorSpec((hd,), BF16)
    _linear(out, f"{p}.attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups, w)
    _linear(out, f"{p}.attn.wo_b", D, a.o_groups * a.o_lora_rank, w)
    out[f"{p}.attn.attn_sink"] = TensorSpec((a.n_heads,), F32)
    if kind != SLIDING:
        m, c = (a.csa_ratio, 2) if kind == CSA else (a.hca_ratio, 1)
        _compressor(out, f"{p}.attn.compressor", a, m, c * hd, hd)
    if kind == CSA:
        di, hi = a.index_head_dim, a.index_n_heads
        _linear(out, f"{p}.attn.indexer.wq_b", hi * di, a.q_lora_rank, w)
        _linear(out, f"{p}.attn.indexer.weights_proj", hi, D, "bf16")
        _compressor(out, f"{p}.attn.indexer.compressor", a, a.csa_ratio, 2 * di, di)
    out[f"{p}.ffn.gate.weight"] = TensorSpec((a.n_routed_experts, D), BF16)
    if hash_moe:
        out[f"{p}.ffn.gate.tid2eid"] = TensorSpec(
            (a.vocab_size, a.n_activated_experts), torch.int64
        )
    else:
        out[f"{p}.ffn.gate.bias"] = TensorSpec((a.n_routed_experts,), F32)
    for e in range(a.n_routed_experts):
        _linear(out, f"{p}.ffn.experts.{e}.w1", a.moe_inter_dim, D, a.expert_dtype)
        _linear(out, f"{p}.ffn.experts.{e}.w2", D, a.moe_inter_dim, a.expert_dtype)
        _linear(out, f"{p}.ffn.experts.{e}.w3", a.moe_inter_dim, D, a.expert_dtype)
    if a.n_shared_experts:
        inter = a.moe_inter_dim * a.n_shared_experts
        _linear(out, f"{p}.ffn.shared_experts.w1", inter, D, w)
        _linear(out, f"{p}.ffn.shared_experts.w2", D, inter, w)
        _linear(out, f"{p}.ffn.shared_experts.w3", inter, D, w)


def _compressor(out: dict, p: str, a: ModelArgs, ratio: int, width: int, head_dim: int) -> None:
    _linear(out, f"{p}.wkv", width, a.dim, "bf16")
    _linear(out, f"{p}.wgate", width, a.dim, "bf16")
    out[f"{p}.ape"] = TensorSpec((ratio, width), torch.float32)
    out[f"{p}.norm.weight"] = TensorSpec((head_dim,), torch.bfloat16)


def checkpoint_tensors(args: ModelArgs) -> dict[str, TensorSpec]:
    """Every tensor of an official-layout checkpoint (spec 10.2): name -> shape, dtype, format."""
    a, F32 = args, torch.float32
    out: dict[str, TensorSpec] = {
        "embed.weight": TensorSpec((a.vocab_size, a.dim), torch.bfloat16),
        "head.weight": TensorSpec((a.vocab_size, a.dim), torch.bfloat16),
        "norm.weight": TensorSpec((a.dim,), torch.bfloat16),
        "hc_head_fn": TensorSpec((a.hc_mult, a.hc_dim), F32),
        "hc_head_base": TensorSpec((a.hc_mult,), F32),
        "hc_head_scale": TensorSpec((1,), F32),
    }
    for i in range(a.n_layers):
        _block(out, f"layers.{i}", a, a.layer_types[i], a.mlp_layer_types[i] == HASH_MOE)
    for i in range(a.n_mtp_layers):
        p = f"mtp.{i}"
        _block(out, p, a, SLIDING, False)
        _linear(out, f"{p}.e_proj", a.dim, a.dim, a.weight_dtype)
        _linear(out, f"{p}.h_proj", a.dim, a.dim, a.weight_dtype)
        for n in ("enorm", "hnorm", "norm"):
            out[f"{p}.{n}.weight"] = TensorSpec((a.dim,), torch.bfloat16)
        out[f"{p}.hc_head_fn"] = TensorSpec((a.hc_mult, a.hc_dim), F32)
        out[f"{p}.hc_head_base"] = TensorSpec((a.hc_mult,), F32)
        out[f"{p}.hc_head_scale"] = TensorSpec((1,), F32)
    return out


# ---- reading ---------------------------------------------------------------------------------


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index (or the single model.safetensors)."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        files = {name: ckpt_dir / shard for name, shard in weight_map.items()}
    elif (ckpt_dir / "model.safetensors").exists():
        with safe_open(ckpt_dir / "model.safetensors", "pt") as f:
            files = {name: ckpt_dir / "model.safetensors" for name in f.keys()}
    else:
        raise CheckpointError(f"{ckpt_dir}: no {INDEX_FILE} or model.safetensors")
    for shard in sorted(set(files.values())):
        if not shard.exists():
            raise CheckpointError(f"{index}: shard {shard.name} is listed but missing")
    return files


def has_mtp(ckpt_dir: str | Path) -> bool:
    return any(name.startswith("mtp.") for name in checkpoint_files(ckpt_dir))


class _Shards:
    """Open shard handles; headers give dtype/shape without reading data."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files, self.handles = files, {}

    def _f(self, name: str):  # noqa: ANN202
        path = self.files[name]
        if path not in self.handles:
            try:
                self.handles[path] = safe_open(path, "pt")
            except Exception as e:  # safetensors raises its own types for bad headers
                raise CheckpointError(
                    f"shard {path.name}: unreadable safetensors file ({e})"
                ) from None
        return self.handles[path]

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        s = self._f(name).get_slice(name)
        return s.get_dtype(), tuple(s.get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._f(name).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"tensor {name} in {self.files[name].name}: unreadable ({e})"
            ) from None

    def shard_keys(self, name: str) -> set[str]:
        """Every tensor name in the shard that holds `name`."""
        return set(self._f(name).keys())


def verify(args: ModelArgs, files: dict[str, Path], shards: _Shards) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of every tensor against the table; raises naming the first problems."""
    expected = checkpoint_tensors(args)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected))
    if missing:
        raise CheckpointError(
            f"missing tensors ({len(missing)}): {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors ({len(unexpected)}): {unexpected[:8]}"
            + (" ..." if len(unexpected) > 8 else "")
        )
    by_shard: dict[Path, set[str]] = {}
    for name, shard in files.items():
        by_shard.setdefault(shard, set()).add(name)
    for shard, listed in sorted(by_shard.items()):
        absent = sorted(listed - shards.shard_keys(next(iter(listed))))
        if absent:
            raise CheckpointError(
                f"{shard.name}: index lists tensors it does not hold: {absent[:8]}"
            )
    for name, spec in expected.items():
        dtype, shape = shards.header(name)
        want = DTYPE_NAMES[spec.dtype]
        if dtype != want or shape != spec.shape:
            hint = ""
            if spec.fmt == "fp4" and dtype == "F8_E4M3":
                hint = " (an FP8 tensor where the config says FP4-packed experts: expert_dtype mismatch)"
            elif spec.fmt == "fp8" and dtype in ("I8", "U8"):
                hint = " (an FP4-packed tensor where the config says FP8)"
            raise CheckpointError(
                f"tensor {name}: expected {want} {list(spec.shape)}, found {dtype} {list(shape)}{hint}"
            )
    return expected


def companion_names(specs: dict[str, TensorSpec]) -> set[str]:
    """Scale tensors that travel with a quantized `.weight` (loaded and written with it)."""
    return {
        f"{n[: -len('weight')]}{s}"
        for n, sp in specs.items()
        if sp.fmt != "dense"
        for s in SCALE_SUFFIXES[sp.fmt]
    }


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path, progress: bool = True) -> None:
    """Stream the checkpoint into `model` tensor by tensor, strictly.

    Every checkpoint tensor is consumed exactly once and every model parameter is written once.
    Quantized weights are copied as they are when the model keeps them packed, else dequantized
    exactly into the parameter's dtype. A parameter with a `weight_loader(param, tensor)` attribute
    (tensor/expert sharding) receives the full tensor and copies its own part; tensors another
    rank holds (`model.elsewhere(name)`: routed experts under expert parallelism) are not read.
    """
    args: ModelArgs = model.args
    files = checkpoint_files(ckpt_dir)
    shards = _Shards(files)
    expected = verify(args, files, shards)
    params = model.state_dict(keep_vars=True)  # persistent parameters and buffers, by key
    companions = companion_names(expected)
    written: set[str] = set()
    consumed: set[str] = set()
    elsewhere = getattr(model, "elsewhere", lambda name: False)
    for name in [n for n in expected if elsewhere(n)]:
        if name in params:
            raise CheckpointError(f"tensor {name}: held by another rank, yet a parameter here")
        consumed.add(name)
    names = sorted(
        (n for n in expected if n not in companions and n not in consumed),
        key=lambda n: (str(files[n]), n),
    )
    bar = _progress(names, progress, desc=f"loading {Path(ckpt_dir).name}")
    for name in bar:
        spec = expected[name]
        tensor = shards.get(name)
        consumed.add(name)
        stem = name[: -len("weight")]
        extra = {s: shards.get(stem + s) for s in SCALE_SUFFIXES.get(spec.fmt, ())}
        consumed.update(stem + s for s in extra)
        for key, t in ((name, tensor), *((stem + s, t) for s, t in extra.items())):
            _check_nan_codes(key, t)
        _write(params, name, spec, tensor, extra, written)
    missing = sorted(set(params) - written)
    if missing or consumed != set(expected):
        raise CheckpointError(
            f"parameters not written: {missing[:8]}; "
            f"tensors not consumed: {sorted(set(expected) - consumed)[:8]}"
        )
    join = getattr(model, "join_projections", None)  # dsv4.model.Transformer: weights are final
    if join is not None:
        join()


def _write(
    params: dict[str, torch.Tensor],
    name: str,
    spec: TensorSpec,
    tensor: torch.Tensor,
    extra: dict[str, torch.Tensor],
    written: set[str],
) -> None:
    # one checkpoint tensor (a quantized weight with its scales `extra`, by suffix) into its
    # parameter: copied packed when the model keeps it packed, else dequantized exactly
    if name not in params:
        raise CheckpointError(f"checkpoint tensor {name} has no model parameter")
    target = params[name]
    packed = target.dtype == spec.dtype and spec.fmt != "dense"
    if spec.fmt != "dense" and not packed:  # reference path: dequantize exactly
        s1 = extra.get("scale", extra.get("weight_scale"))
        tensor = _dequant(name, tensor, spec.fmt, s1, extra.get("weight_scale_2"), target.dtype)
    else:
        stem = name[: -len("weight")]
        for s, t in extra.items():
            _copy(params, stem + s, t, written)
    _copy(params, name, tensor, written)


QUANTIZERS = {"fp8": quant.quant_fp8, "fp4": quant.quant_mxfp4, "nvfp4": quant.quant_nvfp4}


def load_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Write some of the checkpoint's tensors into `model` from memory (an RL trainer's weight
    update: SGLang's update_weights_from_tensor), with the loader's checks, all of them before
    anything is written: names from the table, each at most once; shapes, and dtypes (a float
    tensor in another float dtype is rounded to the checkpoint's); a quantized weight with all
    its scales, or instead as one float tensor of the weight's [out, in], quantized here
    (`dsv4.quant`, as the release's formats); no NaN codes. Every rank checks
    every tensor (the same verdict everywhere) and writes its own part; another rank's experts
    are skipped. Returns the names written."""
    expected = checkpoint_tensors(model.args)
    given: dict[str, torch.Tensor] = {}
    for name, t in named:
        if name in given:
            raise CheckpointError(f"tensor {name} given twice")
        given[name] = t
    unknown = sorted(set(given) - set(expected))
    if unknown:
        raise CheckpointError(
            f"tensors not in the checkpoint's table ({len(unknown)}): {unknown[:8]}"
        )
    companions = companion_names(expected)
    work = []
    used: set[str] = set()
    for name, t in given.items():
        if name in companions:
            continue
        spec, stem = expected[name], name[: -len("weight")]
        if spec.fmt == "dense" and t.is_floating_point() and spec.dtype.is_floating_point:
            t = t.to(spec.dtype)  # (a trainer's fp32 / bf16: rounded as the checkpoint stores it)
        suffixes = SCALE_SUFFIXES.get(spec.fmt, ())
        extra = {s: given[stem + s] for s in suffixes if stem + s in given}
        used.update(stem + s for s in extra)
        if suffixes and not extra and t.is_floating_point() and t.dtype != spec.dtype:
            try:  # one float weight: quantized as the checkpoint stores it
                t, *scales = QUANTIZERS[spec.fmt](t)
            except ValueError as e:
                raise CheckpointError(f"tensor {name}: {e}") from None
            extra = dict(zip(suffixes, scales))
        elif len(extra) != len(suffixes):
            lack = [stem + s for s in suffixes if s not in extra]
            raise CheckpointError(f"tensor {name}: given without {lack} (or give it unquantized)")
        for key, x in ((name, t), *((stem + s, x) for s, x in extra.items())):
            want = expected[key]
            if x.dtype != want.dtype or tuple(x.shape) != want.shape:
                raise CheckpointError(
                    f"tensor {key}: expected {DTYPE_NAMES[want.dtype]} {list(want.shape)}, "
                    f"given {x.dtype} {list(x.shape)}"
                )
            _check_nan_codes(key, x)
        work.append((name, spec, t, extra))
    orphans = sorted(set(given) & companions - used)
    if orphans:
        raise CheckpointError(f"scales given without their weight: {orphans[:8]}")
    params = model.state_dict(keep_vars=True)
    elsewhere = getattr(model, "elsewhere", lambda name: False)
    work = [w for w in work if not elsewhere(w[0])]
    missing = [w[0] for w in work if w[0] not in params]
    if missing:
        raise CheckpointError(f"checkpoint tensors with no model parameter: {missing[:8]}")
    written: set[str] = set()
    for name, spec, t, extra in work:
        _write(params, name, spec, t, extra, written)
    return [w[0] for w in work]


def _dequant(
    name: str,
    t: torch.Tensor,
    fmt: str,
    s1: torch.Tensor,
    s2: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    try:
        if fmt == "fp8":
            return quant.dequant_fp8(t, s1, dtype)
        if fmt == "fp4":
            return quant.dequant_mxfp4(t, s1, dtype)
        return quant.dequant_nvfp4(t, s1, s2, dtype)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from None


def _check_nan_codes(name: str, t: torch.Tensor) -> None:
    # the NaN encodings of the stored 8-bit formats (e4m3 0x7F / 0xFF, e8m0 0xFF): the kernels that
    # decode codes with bit operations would read them as finite weights
    if t.dtype == torch.float8_e4m3fn:
        bad = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
        what = "e4m3 NaN codes"
    elif t.dtype == torch.float8_e8m0fnu:
        bad = int((t.view(torch.uint8) == 0xFF).sum())
        what = "e8m0 NaN scales (255)"
    else:
        return
    if bad:
        raise CheckpointError(f"tensor {name}: {bad} {what}")


def _copy(params: dict[str, torch.Tensor], name: str, t: torch.Tensor, written: set[str]) -> None:
    if name not in params:
        raise CheckpointError(f"checkpoint tensor {name} has no model parameter")
    if name in written:
        raise CheckpointError(f"parameter {name} written twice")
    p = params[name]
    loader = getattr(p, "weight_loader", None)
    if loader is not None:
        try:
            loader(p, t)
        except ValueError as e:
            raise CheckpointError(f"tensor {name}: {e}") from None
    else:
        if tuple(p.shape) != tuple(t.shape):
            raise CheckpointError(
                f"tensor {name}: parameter shape {list(p.shape)}, checkpoint {list(t.shape)}"
            )
        if not t.is_floating_point() and p.is_floating_point():
            raise CheckpointError(f"tensor {name}: integer {t.dtype} into float parameter")
        with torch.no_grad():
            p.copy_(t.to(p.dtype) if p.dtype != t.dtype else t)
    written.add(name)


def _progress(items: list, enabled: bool, desc: str) -> Iterable:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor", leave=False)


# ---- writing ---------------------------------------------------------------------------------


def save_checkpoint(
    tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str | Path, shard_bytes: int = 64 << 20
) -> int:
    """Write (name, tensor) pairs as sharded safetensors + index; returns the number of shards."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    tmp_names: list[str] = []
    weight_map: dict[str, int] = {}
    size = total = 0

    def flush() -> None:  # one shard in memory at a time
        tmp = f".shard-{len(tmp_names)}.tmp"
        save_file(shard, str(out_dir / tmp), metadata={"format": "pt"})
        tmp_names.append(tmp)
        shard.clear()

    for name, t in tensors:
        if name in weight_map or name in shard:
            raise CheckpointError(f"tensor {name} written twice")
        if size and size + t.nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t.contiguous()
        weight_map[name] = len(tmp_names)
        size += t.nbytes
        total += t.nbytes
    flush()
    n = len(tmp_names)
    final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, final):
        os.replace(out_dir / tmp, out_dir / name)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: final[v] for k, v in sorted(weight_map.items())},
    }
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return n
