"""Strict loading: every key consumed once, every parameter written, malformed checkpoints refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    checkpoint_files,
    checkpoint_tensors,
    load_checkpoint,
)
from dsv4.config import ConfigError
from dsv4.llm import LLM
from dsv4.model import Transformer
from dsv4.tiny import make_tiny, tiny_args

ARGS = tiny_args(vocab_size=270, n_routed_experts=4)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("good"), ARGS, tokenizer="none", shard_bytes=1 << 16)


def test_sharded_and_indexed(good: Path):
    files = checkpoint_files(good)
    assert len(set(files.values())) > 1
    assert set(files) == set(checkpoint_tensors(ARGS))
    assert any(n.startswith("mtp.0.") for n in files)


@pytest.mark.parametrize("quantized", [False, True])
def test_module_paths_are_checkpoint_keys(quantized: bool):
    sd = Transformer(ARGS, quantized=quantized).state_dict()
    table = checkpoint_tensors(ARGS)
    if quantized:  # packed weights keep every tensor, scales included, under its own name
        assert set(sd) == set(table)
        for name, spec in table.items():
            if spec.fmt != "dense" or name.endswith(("scale",)):
                assert sd[name].dtype == spec.dtype, name
    else:  # dequantized: the scales fold into their weight
        assert set(sd) == {n for n in table if not n.endswith(".scale")}


def test_every_parameter_written(good: Path):
    model = Transformer(ARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan")) if p.is_floating_point() else p.fill_(-1)
    load_checkpoint(model, good, progress=False)
    for name, t in model.state_dict().items():
        assert t.isfinite().all() if t.is_floating_point() else (t >= 0).all(), name


def test_mtp_is_optional(tmp_path: Path):
    d = make_tiny(tmp_path / "nomtp", ARGS.replace(n_mtp_layers=0), tokenizer="none")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1  # config announces MTP, checkpoint has none: load without
    cfg["compress_ratios"] = cfg["compress_ratios"] + [0]
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(d, progress=False)
    assert llm.args.n_mtp_layers == 0 and len(llm.model.mtp) == 0


# ---- malformed checkpoints ---------------------------------------------------------------------


def _copy(good: Path, tmp: Path) -> Path:
    d = tmp / "bad"
    shutil.copytree(good, d)
    return d


def _rewrite(d: Path, name: str, tensor: torch.Tensor | None, new_name: str | None = None) -> None:
    """Replace (or drop, or add under new_name) one tensor in its shard, keeping the index right."""
    index = json.loads((d / INDEX_FILE).read_text())
    shard = d / index["weight_map"][name]
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if new_name is not None:
        tensors[new_name] = tensor
        index["weight_map"][new_name] = shard.name
    elif tensor is None:
        del tensors[name]
        del index["weight_map"][name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(shard))
    (d / INDEX_FILE).write_text(json.dumps(index))


def _load(d: Path) -> None:
    load_checkpoint(Transformer(ARGS), d, progress=False)


EXPERT = "layers.1.ffn.experts.0.w1"


def test_refuses_fp4_expert_presented_as_fp8(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    w = torch.zeros(ARGS.moe_inter_dim, ARGS.dim, dtype=torch.float8_e4m3fn)
    _rewrite(d, f"{EXPERT}.weight", w)
    with pytest.raises(CheckpointError, match=rf"{EXPERT}\.weight: expected I8 .*found F8_E4M3"):
        _load(d)


def test_refuses_fp4_bytes_where_fp8_expected(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, "layers.0.attn.wkv.weight", torch.zeros(ARGS.head_dim, ARGS.dim, dtype=torch.int8))
    with pytest.raises(CheckpointError, match=r"wkv\.weight: expected F8_E4M3 .*found I8.*FP4"):
        _load(d)


def test_refuses_scale_of_wrong_shape(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, f"{EXPERT}.scale", torch.zeros(ARGS.moe_inter_dim, 1, dtype=torch.float8_e8m0fnu))
    with pytest.raises(CheckpointError, match=rf"{EXPERT}\.scale: expected F8_E8M0 \[32, 2\]"):
        _load(d)


def _read(d: Path, name: str) -> torch.Tensor:
    index = json.loads((d / INDEX_FILE).read_text())
    with safe_open(d / index["weight_map"][name], "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("suffix,bad", [("weight", 0x7F), ("weight", 0xFF), ("scale", 0xFF)])
def test_refuses_nan_codes(good: Path, tmp_path: Path, quantized: bool, suffix: str, bad: int):
    # e4m3 NaN codes in an FP8 weight and the e8m0 NaN scale: refused, whether the weights are kept
    # packed (kernels decode them with bit operations) or dequantized
    key = f"layers.0.attn.wkv.{suffix}"
    d = _copy(good, tmp_path)
    t = _read(d, key).clone()
    t.view(torch.uint8).view(-1)[-1] = bad
    _rewrite(d, key, t)
    what = "e4m3 NaN codes" if suffix == "weight" else r"e8m0 NaN scales \(255\)"
    with pytest.raises(CheckpointError, match=rf"{key}: 1 {what}"):
        load_checkpoint(Transformer(ARGS, quantized=quantized), d, progress=False)


def test_refuses_missing_tensor(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, "layers.2.attn.compressor.ape", None)
    with pytest.raises(
        CheckpointError, match=r"missing tensors \(1\): \['layers\.2\.attn\.compressor\.ape'\]"
    ):
        _load(d)


def test_refuses_unexpected_tensor(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, "norm.weight", torch.zeros(3), new_name="layers.0.attn.extra")
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors \(1\): \['layers\.0\.attn\.extra'\]"
    ):
        _load(d)


def test_refuses_wrong_dtype_of_fp32_tensor(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, "layers.0.attn.attn_sink", torch.zeros(ARGS.n_heads, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"attn_sink: expected F32 \[4\], found BF16 \[4\]"):
        _load(d)


def test_refuses_int32_hash_table(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    _rewrite(d, "layers.0.ffn.gate.tid2eid", torch.zeros(ARGS.vocab_size, 2, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"tid2eid: expected I64"):
        _load(d)


def test_refuses_missing_shard(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {victim.name} is listed but missing"):
        _load(d)


def test_refuses_index_pointing_to_wrong_shard(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"does not hold: \['{name}'\]"):
        _load(d)


def test_refuses_corrupt_index(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    (d / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"malformed index"):
        _load(d)


def test_refuses_config_that_disagrees_with_checkpoint(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["expert_dtype"] = "fp8"  # the shards hold MXFP4 experts
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"experts\.0\.w1\.weight: expected F8_E4M3 \[32, 64\], found I8 \[32, 32\]",
    ):
        LLM(d, progress=False)


def test_refuses_config_missing_field(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["index_topk"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"missing required field 'index_topk'"):
        LLM(d, progress=False)


def test_refuses_truncated_shard(good: Path, tmp_path: Path):
    d = _copy(good, tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=shard.name):
        _load(d)
