"""make-tiny: official layout, release-like formats, non-zero sinks/biases/ape, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.checkpoint import checkpoint_files
from dsv4.cli import main
from dsv4.config import ModelArgs
from dsv4.llm import LLM
from tests.reference import independent_dequant


@pytest.mark.parametrize("expert", ["fp4", "nvfp4", "fp8", "bf16"])
def test_make_tiny_cli(tmp_path, expert, capsys):  # noqa: ANN001
    out = tmp_path / "m"
    assert (
        main(
            [
                "make-tiny",
                str(out),
                "--vocab-size",
                "300",
                "--expert-dtype",
                expert,
                "--layers",
                "hca,sliding,csa",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    args = ModelArgs.from_json(out)
    assert args.expert_dtype == expert and args.n_layers == 3
    for f in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert (out / f).exists()
    w = independent_dequant(out)
    for name in (
        "layers.0.attn.attn_sink",
        "layers.1.ffn.gate.bias",
        "layers.0.attn.compressor.ape",
        "hc_head_base",
        "layers.2.attn.indexer.compressor.ape",
    ):
        assert (w[name] != 0).all(), f"{name} has zeros"
    tid = w["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int64 and (tid.sort(-1).values.diff(dim=-1) > 0).all()
    dtypes = {n: t.dtype for n, t in _raw(out).items()}
    assert dtypes["layers.0.attn.wq_a.weight"] == torch.float8_e4m3fn
    want = {
        "fp4": torch.int8,
        "nvfp4": torch.uint8,
        "fp8": torch.float8_e4m3fn,
        "bf16": torch.bfloat16,
    }
    assert dtypes["layers.1.ffn.experts.0.w1.weight"] == want[expert]
    assert LLM(out, progress=False).score([0, 5, 6]).shape == (3, 300)


def _raw(d):  # noqa: ANN001, ANN202
    from safetensors import safe_open

    out = {}
    for shard in set(checkpoint_files(d).values()):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_make_tiny_bad_layers(tmp_path, capsys):  # noqa: ANN001
    assert main(["make-tiny", str(tmp_path / "x"), "--layers", "sliding,mla"]) == 2
    assert "mla" in capsys.readouterr().err


def test_official_key_style(tmp_path):  # noqa: ANN001
    main(["make-tiny", str(tmp_path / "m"), "--vocab-size", "300"])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["expert_dtype"] == "fp4"
    assert cfg["rope_scaling"]["type"] == "yarn"
