from __future__ import annotations

import json

import pytest

from dsv4.config import ModelArgs, flash_args
from dsv4.roofline import (
    GPUS,
    distinct_experts,
    get_gpu,
    main,
    param_counts,
    roofline,
    state_bytes_per_token,
)

FLASH = flash_args()
H200 = GPUS["H200"]
TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 16, 4],
    "num_hash_layers": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 8,
    "expert_dtype": "bf16",
}


def rows(r):
    return {c.name: c for c in r.components}


def test_param_counts_flash():  # spec 11.1
    p = param_counts(FLASH)
    assert p["total"] == pytest.approx(284.33e9, rel=1e-4)
    assert p["active"] == pytest.approx(13.27e9, rel=1e-3)
    assert p["mtp"] == pytest.approx(6.61e9, rel=1e-3)
    assert p["attn_proj"] == 43 * 106_956_352
    assert p["experts"] == 43 * 256 * 25_165_824
    assert p["embed"] == p["head"] == 529_530_880


def test_weight_bytes_batch1():  # spec 11.2: ~11.2 GB per token; anchors e.2: 2.34 ms on H200
    r = roofline(FLASH, 1, 4096, H200)
    assert r.weight_bytes == pytest.approx(11.21e9, rel=0.02)
    c = rows(r)
    assert c["attn_proj"].weight_bytes == pytest.approx(4.60e9, rel=0.01)
    assert c["experts"].weight_bytes == pytest.approx(3.45e9, rel=0.01)
    assert c["shared_expert"].weight_bytes == pytest.approx(1.08e9, rel=0.01)
    assert c["head"].weight_bytes == pytest.approx(1.06e9, rel=0.01)
    assert c["compressor"].weight_bytes == pytest.approx(0.8e9, rel=0.02)
    assert r.floor_s == pytest.approx(2.34e-3, rel=0.02)
    assert r.tok_per_s == pytest.approx(428, rel=0.02)


def test_batch16_anchor():  # anchors e.2: 80.8 experts, 54.2 GB, 11.3 ms per step
    assert distinct_experts(256, 6, 16) == pytest.approx(80.8, abs=0.05)
    r = roofline(FLASH, 16, 8192, H200, state_dtype="fp8")
    assert r.config["distinct_experts"] == pytest.approx(80.8, abs=0.05)
    assert r.weight_bytes == pytest.approx(54.2e9, rel=0.02)
    assert r.floor_s == pytest.approx(11.3e-3, rel=0.02)


def test_state_growth():  # spec 9.6
    assert state_bytes_per_token(FLASH, "bf16") == 6880
    assert state_bytes_per_token(FLASH, "fp8") == pytest.approx(3850, abs=1)


@pytest.mark.parametrize(
    "ctx,gflop,bf16_mb,fp8_mb",
    [
        (4096, 29.1, 22.8, 12.7),
        (65536, 35.7, 115, 61),
        (131072, 42.6, 214, 112),
        (1 << 20, 140.3, 1590, 830),
    ],
)
def test_flops_and_state_reads(ctx, gflop, bf16_mb, fp8_mb):  # spec 11.3 table
    r = roofline(FLASH, 1, ctx, H200)
    assert r.flops / 1e9 == pytest.approx(gflop, rel=0.02)
    assert r.state_bytes / 1e6 == pytest.approx(bf16_mb, rel=0.02)
    r8 = roofline(FLASH, 1, ctx, H200, state_dtype="fp8")
    assert r8.state_bytes / 1e6 == pytest.approx(fp8_mb, rel=0.02)
    assert r8.flops == r.flops


def test_monotone_in_context_and_batch():
    ctx = [roofline(FLASH, 1, L, H200).state_bytes for L in (128, 1024, 4096, 65536, 1 << 20)]
    assert ctx == sorted(ctx) and len(set(ctx)) == len(ctx)
    per_expert = rows(roofline(FLASH, 1, 4096, H200))["experts"].weight_bytes / (43 * 6)
    prev = 0.0
    for b in (1, 2, 4, 16, 64, 256, 4096):
        r = roofline(FLASH, b, 4096, H200)
        eb = rows(r)["experts"].weight_bytes
        assert prev < eb <= 43 * 256 * per_expert * (1 + 1e-9)
        assert r.state_bytes == pytest.approx(b * ctx[2])  # state reads are per sequence
        prev = eb
    assert prev == pytest.approx(43 * 256 * per_expert, rel=1e-6)  # saturates at all experts


def test_prefill():
    s = 8192
    r = roofline(FLASH, 1, s, H200, mode="prefill")
    assert r.tokens == s and r.config["distinct_experts"] == pytest.approx(256)
    assert r.weight_bytes == pytest.approx(156e9, rel=0.02)  # every weight read once (spec 11.2)
    dec = rows(roofline(FLASH, 1, s, H200))
    # causal halving: the indexer scans L/4 entries, so on average half of the last query's
    assert rows(r)["indexer"].flops == pytest.approx(s * dec["indexer"].flops / 2, rel=0.01)
    assert rows(r)["attention"].flops < s * dec["attention"].flops
    assert rows(r)["experts"].flops == pytest.approx(s * dec["experts"].flops, rel=1e-9)
    assert rows(r)["head"].flops == dec["head"].flops  # logits for the last position only
    chunk = roofline(FLASH, 1, 2 * s, H200, mode="prefill", prompt_len=s)
    assert rows(chunk)["indexer"].flops > rows(r)["indexer"].flops  # sees a cached prefix
    assert r.tok_per_s == pytest.approx(s / r.floor_s)


def test_bad_arguments():
    with pytest.raises(ValueError, match="state_dtype"):
        roofline(FLASH, 1, 4096, H200, state_dtype="fp16")
    with pytest.raises(ValueError, match="prompt_len"):
        roofline(FLASH, 1, 4096, H200, mode="prefill", prompt_len=5000)
    with pytest.raises(ValueError, match="mode"):
        roofline(FLASH, 1, 4096, H200, mode="train")
    with pytest.raises(ValueError, match="H200"):
        get_gpu("A100")
    assert get_gpu("rtx pro 6000") is GPUS["RTX-PRO-6000"] and get_gpu("h100") is GPUS["H100"]


def test_tiny_config_from_dict(tmp_path):
    args = ModelArgs.from_dict(TINY)
    p = param_counts(args)
    assert p["total"] == sum(v for k, v in p.items() if k not in ("total", "active", "mtp"))
    r = roofline(args, 3, 100, GPUS["B200"], state_dtype="fp8")
    assert r.floor_s > 0 and r.total_bytes == r.weight_bytes + r.state_bytes
    assert r.config["distinct_experts"] == pytest.approx(8 * (1 - 0.75**3))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert main(["--model", str(tmp_path), "--gpu", "H100", "--context", "64"]) == 0


def test_cli_json(capsys):
    assert (
        main(
            [
                "--preset",
                "flash",
                "--batch",
                "4",
                "--context",
                "8192",
                "--gpu",
                "H200",
                "--state-dtype",
                "fp8",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for k in (
        "weight_bytes",
        "state_bytes",
        "total_bytes",
        "flops",
        "floor_s",
        "components",
        "config",
    ):
        assert k in d
    assert d["config"]["batch"] == 4 and d["config"]["gpu"]["name"] == "H200"
    assert d["total_bytes"] == pytest.approx(d["weight_bytes"] + d["state_bytes"])
    assert d["floor_s"] == pytest.approx(sum(c["floor_s"] for c in d["components"]))


def test_cli_table_overrides_and_bench(capsys, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps({"components": {"experts": 5e-3, "attn_proj": 2e-3}, "step_s": 10e-3})
    )
    assert (
        main(["--batch", "1", "--bandwidth", "1000", "--flops", "100", "--bench", str(bench)]) == 0
    )
    out = capsys.readouterr().out
    assert "attn_proj" in out and "tok/s" in out and "meas/floor" in out
    assert "1000 GB/s" in out
    assert main(["--bench", str(bench), "--json", "--mode", "prefill", "--context", "1024"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bench"]["step"]["ratio"] == pytest.approx(10e-3 / d["floor_s"])


def test_cli_unknown_gpu(capsys):
    assert main(["--gpu", "A100"]) == 2
    err = capsys.readouterr().err
    assert "A100" in err and all(name in err for name in GPUS)


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_tensor_parallel_rank(batch):
    # one rank of two reads half of the split tensors and of the experts it meets, all of the
    # replicated ones (the K=V state included), and sends its all-reduces over NVLink
    one, two = (
        rows(roofline(FLASH, batch, 4096, H200)),
        rows(roofline(FLASH, batch, 4096, H200, tp=2)),
    )
    a = FLASH
    split = (
        sum(
            x * (1 + 1 / 128**2)  # fp8: a scale byte per 128 x 128 tile
            for x in (
                a.n_heads * a.head_dim * a.q_lora_rank,
                a.o_groups * a.o_lora_rank * a.n_heads * a.head_dim // a.o_groups,
                a.dim * a.o_groups * a.o_lora_rank,
            )
        )
        * a.n_layers
        + a.n_heads * 4 * a.n_layers
    )  # + attn_sink fp32
    drop = one["attn_proj"].weight_bytes - two["attn_proj"].weight_bytes
    assert drop == pytest.approx(split / 2, rel=1e-3)
    for name in ("experts", "shared_expert"):
        assert two[name].weight_bytes == pytest.approx(one[name].weight_bytes / 2)
        assert two[name].flops == pytest.approx(one[name].flops / 2)
    for name in ("compressor", "indexer", "mhc", "router", "head"):
        assert two[name].weight_bytes == one[name].weight_bytes
    assert two["attention"].state_bytes == one["attention"].state_bytes  # one K=V head
    assert two["attention"].flops == pytest.approx(one["attention"].flops / 2)  # half the heads
    comm = 2 * a.n_layers * batch * a.dim * 4  # 2 all-reduces a layer, fp32, ring at tp=2
    assert one["comm"].floor_s == 0 and two["comm"].floor_s == pytest.approx(comm / 450e9)


def test_tensor_parallel_errors_and_cli(capsys):
    with pytest.raises(ValueError, match="tp=3 must divide"):
        roofline(FLASH, 1, 4096, H200, tp=3)
    assert main(["--batch", "16", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["tp"] == 2 and out["config"]["comm_bytes"] > 0
    assert main(["--batch", "16", "--tensor-parallel-size", "2"]) == 0
    assert "one of 2 ranks" in capsys.readouterr().out
