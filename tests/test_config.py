"""config.json in both key styles -> one typed ModelArgs; inconsistencies name the field."""

from __future__ import annotations

import copy

import pytest

from dsv4.config import (
    AUTO_FLAGS,
    CSA,
    HCA,
    SLIDING,
    ConfigError,
    EngineConfig,
    ModelArgs,
    flash_args,
    resolve_engine,
    yarn_inv_freq,
)


def official() -> dict:
    return flash_args().to_dict()


def transformers_style() -> dict:
    d = official()
    del d["compress_ratios"], d["num_hash_layers"], d["rope_scaling"], d["qk_rope_head_dim"]
    del d["compress_rope_theta"], d["rope_theta"]
    d["layer_types"] = [SLIDING] * 2 + [CSA, HCA] * 20 + [CSA]
    d["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    d["partial_rotary_factor"] = 64 / 512
    d["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    return d


def test_flash_schedule():
    a = flash_args()
    assert a.layer_types[:3] == (SLIDING, SLIDING, CSA) and a.layer_types[3] == HCA
    assert a.layer_types.count(CSA) == 21 and a.layer_types.count(HCA) == 20
    assert a.mlp_layer_types.count("hash_moe") == 3 and a.n_mtp_layers == 1
    assert (a.weight_dtype, a.expert_dtype) == ("fp8", "fp4")


def test_both_styles_give_the_same_args():
    assert ModelArgs.from_dict(transformers_style()) == ModelArgs.from_dict(official())


def test_round_trip():
    a = flash_args()
    assert ModelArgs.from_dict(a.to_dict()) == a


def test_yarn_frequencies_match_spec():
    # spec 3.2: ramp_i = clamp((i - 15) / 10, 0, 1): pairs <= 15 untouched, 16..24 interpolated,
    # >= 25 divided by 16
    a = flash_args()
    base = yarn_inv_freq(64, 160000.0, None)
    f = yarn_inv_freq(64, 160000.0, a.yarn)
    assert (f[:16] == base[:16]).all()
    assert ((f[25:] - base[25:] / 16).abs() <= 1e-7 * base[25:]).all()
    assert ((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16)).all()


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.pop("compress_ratios"), "compress_ratios"),
        (lambda d: d.update(compress_ratios=[0, 4, 128]), "compress_ratios"),
        (lambda d: d.update(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 64]), "compress_ratios"),
        (lambda d: d.update(layer_types=[SLIDING] * 43), "layer_types"),
        (lambda d: d.update(mlp_layer_types=["moe"] * 43), "mlp_layer_types"),
        (lambda d: d["quantization_config"].update(fmt="e5m2"), "quantization_config.fmt"),
        (lambda d: d["quantization_config"].update(scale_fmt="fp32"), "scale_fmt"),
        (
            lambda d: d["quantization_config"].update(weight_block_size=[1, 128]),
            "weight_block_size",
        ),
        (lambda d: d["rope_scaling"].pop("factor"), "factor"),
        (lambda d: d.update(partial_rotary_factor=0.25), "partial_rotary_factor"),
        (lambda d: d.update(num_key_value_heads=8), "num_key_value_heads"),
        (lambda d: d.update(expert_dtype="int3"), "expert_dtype"),
        (lambda d: d.update(o_groups=7), "o_groups"),
        (lambda d: d.update(scoring_func="softmax"), "scoring_func"),
        (lambda d: d.update(dim=1024), "conflicting values"),
    ],
)
def test_inconsistencies_name_the_field(edit, field):  # noqa: ANN001
    d = copy.deepcopy(official())
    edit(d)
    with pytest.raises(ConfigError, match=field):
        ModelArgs.from_dict(d)


FAST = dict(device="cuda", dtype="bfloat16", ops="triton", quantized=True, cuda_graphs=True)
EXACT = dict(device="cpu", dtype="float32", ops="ref", quantized=False, cuda_graphs=False)


def engine_flags(config) -> dict:  # noqa: ANN001  (EngineConfig or ServerConfig)
    """The flags `resolve_engine` fills in, as `config` holds them."""
    return {k: getattr(config, k) for k in AUTO_FLAGS}


@pytest.mark.parametrize("cuda", [False, True])
def test_engine_auto_flags(cuda, monkeypatch):  # noqa: ANN001
    # "auto" / None: the GPU fast path where torch sees CUDA, the exact CPU path elsewhere
    monkeypatch.setattr("dsv4.config.cuda_available", lambda: cuda)
    auto = resolve_engine()
    assert auto == (FAST if cuda else EXACT)
    EngineConfig(**auto)  # a combination the engine accepts
    assert resolve_engine(device="cpu") == EXACT


def test_engine_explicit_flags_kept(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr("dsv4.config.cuda_available", lambda: True)
    assert resolve_engine(device="cuda:1")["device"] == "cuda:1"
    # graphs default on only where EngineConfig allows them
    assert resolve_engine(ops="ref") == FAST | dict(ops="ref", cuda_graphs=False)
    assert resolve_engine(quantized=False) == FAST | dict(quantized=False, cuda_graphs=False)
    assert resolve_engine(dtype="float32", cuda_graphs=False) == FAST | dict(
        dtype="float32", cuda_graphs=False
    )
    assert resolve_engine(device="cpu", ops="triton") == EXACT | dict(ops="triton")
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(**resolve_engine(device="cpu", cuda_graphs=True))


def test_engine_bad_device(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr("dsv4.config.cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="'cuda' asked for, but torch sees no CUDA device"):
        resolve_engine(device="cuda")
    with pytest.raises(ConfigError, match="'gpu0' is not a torch device"):
        resolve_engine(device="gpu0")


def test_check_sizes_names_every_bad_size():
    from dsv4.config import AUTO_SEQ_LEN, ConfigError, check_sizes

    check_sizes(max_seqs=1, max_seq_len=AUTO_SEQ_LEN, chunk_size=None)
    with pytest.raises(
        ConfigError, match=r"max_seqs=0, max_seq_len=-2: max_seqs, max_seq_len must"
    ):
        check_sizes(max_seqs=0, max_seq_len=-2)
    with pytest.raises(ConfigError, match="chunk_size must be >= 1"):
        check_sizes(max_seqs=1, max_seq_len=AUTO_SEQ_LEN, chunk_size=0)
