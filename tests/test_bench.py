"""`dsv4 bench step` at tiny sizes on the CPU: JSON, projection, breakdown, transformers, args."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4 import roofline
from dsv4.bench import step
from dsv4.bench.breakdown import CATEGORIES
from dsv4.bench.weights import fill_state_, init_random_
from dsv4.config import flash_args
from dsv4.model import Transformer
from dsv4.ops import select
from dsv4.state import Batch, DecodeState

BASE = ["--preset", "tiny", "--device", "cpu", "--repeat", "2", "--warmup", "1"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # noqa: ANN201
    # tiny ops on a shared CPU: a thread pool only adds contention (10-50x slower steps)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def result(tmp_path_factory):  # noqa: ANN001, ANN201
    path = tmp_path_factory.mktemp("bench") / "step.json"
    argv = BASE + [
        "--layers",
        "sliding,csa:hash,hca",
        "--batch",
        "1,2",
        "--context",
        "40,200",
        "--prefill",
        "24",
        "--chunk",
        "16",
        "--profile",
        "--json",
        str(path),
    ]
    assert step.main(argv) == 0
    return path, json.loads(path.read_text())


def test_json_layout(result):  # noqa: ANN001
    _, res = result
    assert res["schema"] == "dsv4.bench.step/1"
    assert {"env", "config", "projection", "prefill", "runs"} <= set(res)
    assert res["config"]["layer_keys"] == ["sliding", "csa:hash", "hca"]
    assert [(r["batch"], r["context"]) for r in res["runs"]] == [
        (1, 40),
        (1, 200),
        (2, 40),
        (2, 200),
    ]
    pf = res["prefill"]
    assert pf["tokens"] == 24 and pf["chunk"] == 16 and pf["chunks"] == 2
    for timing in [pf] + res["runs"]:
        assert "error" not in timing
        for k in ("sliding", "csa:hash", "hca"):
            s = timing["layers"][k]
            assert 0 < s["min_s"] <= s["median_s"] <= s["max_s"]
            assert len(s["samples"]) == 2
        assert timing["step"]["median_s"] > 0
        assert timing["tok_per_s"] > 0
    for run in res["runs"]:
        assert run["floor"]["floor_s"] > 0 and run["floor"]["gpu"] == "H200"
        assert set(run["distinct_experts"]) == {"sliding", "csa:hash", "hca"}


def test_projection_counts_flash_schedule(result):  # noqa: ANN001
    _, res = result
    plan = res["projection"]
    flash = flash_args()
    assert plan["n_layers"] == flash.n_layers == 43
    # Flash: 2 sliding (hash), 21 CSA (the first hash), 20 HCA; hash sliding measured as top-k
    assert plan["target"] == {"sliding:hash": 2, "csa:hash": 1, "hca": 20, "csa": 20}
    assert plan["counts"] == {"sliding": 2, "csa:hash": 21, "hca": 20}
    assert sum(plan["counts"].values()) == 43
    assert plan["substitutions"] == {"sliding:hash <- sliding": 2, "csa <- csa:hash": 20}


def test_projection_is_the_sum_of_measured_pieces(result):  # noqa: ANN001
    _, res = result
    counts = res["projection"]["counts"]
    for t in [res["prefill"]] + res["runs"]:
        want = t["rest"]["median_s"] + sum(
            n * t["layers"][k]["median_s"] for k, n in counts.items()
        )
        assert t["projected_s"] == pytest.approx(want, rel=1e-12)
        assert t["projected_spread"]["min_s"] <= t["projected_spread"]["max_s"]
    for run in res["runs"]:
        assert run["tok_per_s"] == pytest.approx(run["batch"] / run["projected_s"])
    pf = res["prefill"]
    assert pf["tok_per_s"] == pytest.approx(pf["tokens"] / pf["projected_s"])


def test_breakdown_categories_sum_to_totals(result):  # noqa: ANN001
    # every decode run's breakdown and the prefill's (its chunks under the same categories)
    _, res = result
    for run in [res["prefill"]] + res["runs"]:
        b = run["breakdown"]
        for k, cats in b["per_layer"].items():
            assert set(cats) == set(CATEGORIES)
            assert sum(cats.values()) == pytest.approx(run["layers"][k]["median_s"], rel=1e-9)
        assert sum(b["rest"].values()) == pytest.approx(run["rest"]["median_s"], rel=1e-9)
        assert sum(b["projected"].values()) == pytest.approx(run["projected_s"], rel=1e-9)
        # host time scaled to the median: every named share is non-negative, other too
        assert all(v >= 0 for v in b["projected"].values())
        assert b["per_layer"]["sliding"]["attention"] > 0  # every layer attends
        assert b["per_layer"]["csa:hash"]["indexer+top-k"] > 0  # only CSA has an indexer
        assert b["per_layer"]["hca"]["indexer+top-k"] == 0
        assert b["per_layer"]["sliding"]["compressor"] == 0
        assert b["per_layer"]["hca"]["compressor"] > 0
        assert all(
            b["per_layer"][k]["MoE"] > 0 and b["per_layer"][k]["mHC"] > 0 for k in b["per_layer"]
        )
        if run is not res["prefill"]:  # `dsv4 roofline --bench` reads decode runs
            comps = run["roofline"]["components"]
            assert sum(comps.values()) == pytest.approx(run["projected_s"], rel=1e-9)
            assert run["roofline"]["step_s"] == run["projected_s"]


def test_roofline_reads_the_bench_json(result, capsys):  # noqa: ANN001
    path, res = result
    assert roofline.main(["--batch", "2", "--context", "200", "--bench", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["bench"]
    run = res["runs"][3]
    assert out["step"]["measured_s"] == pytest.approx(run["projected_s"])
    moe = out["experts+shared_expert+router"]
    assert moe["floor_s"] > 0 and moe["measured_s"] == pytest.approx(
        run["breakdown"]["projected"]["MoE"]
    )
    assert roofline.main(["--batch", "3", "--context", "200", "--bench", str(path)]) == 2
    assert "no run at batch=3" in capsys.readouterr().err


def test_hf_comparison(tmp_path):  # noqa: ANN001
    path = tmp_path / "hf.json"
    argv = BASE + [
        "--batch",
        "2",
        "--context",
        "100",
        "--prefill",
        "0",
        "--repeat",
        "1",
        "--hf",
        "--json",
        str(path),
    ]
    assert step.main(argv) == 0
    (run,) = json.loads(path.read_text())["runs"]
    hf = run["hf"]
    assert hf["context"] == 100 and hf["note"] is None
    assert all(v["median_s"] > 0 for v in hf["layers"].values())
    assert hf["ratio_ours_over_hf"] == pytest.approx(run["projected_s"] / hf["projected_s"])


def test_hf_context_is_capped_by_memory(tmp_path):  # noqa: ANN001
    from dsv4.bench.hf import decode_bytes, feasible_context

    args, _ = step.bench_args("flash", step._layer_list("sliding,csa,hca"))
    assert feasible_context(args, 16, 131072, 2, 48e9) == 131072
    assert feasible_context(args, 64, 131072, 2, 48e9) == 32768
    assert decode_bytes(args, 64, 131072, 2) > 100e9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "sliding,mla"], "unknown layer 'mla'"),
        (["--layers", "csa:dense"], "unknown layer 'csa:dense'"),
        (["--batch", "0"], "batch sizes must be >= 1"),
        (["--batch", "1,x"], "comma-separated ints"),
        (["--context", "4096,0"], "contexts must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
    ],
)
def test_bad_arguments(argv, message, capsys):  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        step.main(BASE + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_init_gives_finite_logits(dtype):  # noqa: ANN001
    args, _ = step.bench_args("tiny", step._layer_list("sliding:hash,csa,hca"))
    model = Transformer(args, dtype, quantized=True, ops=select("ref"))
    init_random_(model, seed=3)
    for name, p in model.named_parameters():  # no NaN byte codes, no stale memory
        if p.dtype == torch.float8_e4m3fn:
            assert not bool(((p.view(torch.uint8) & 0x7F) == 0x7F).any()), name
        elif p.is_floating_point() and p.element_size() >= 2:
            assert bool(torch.isfinite(p).all()), name
    state = DecodeState(args, 3, 301, dtype, "cpu")
    fill_state_(state, seed=3)
    with torch.inference_mode():
        batch = Batch.build([0, 1, 2], [300, 300, 300], [1, 1, 1], state)
        logits = model.logits(model(torch.tensor([5, 6, 7]), batch, state))
    assert bool(torch.isfinite(logits).all())
    assert 0.1 < float(logits.float().std()) < 10  # O(1) activations, not just finite


@pytest.mark.gpu
def test_flash_width_on_gpu(tmp_path):  # noqa: ANN001
    path = tmp_path / "flash.json"
    argv = [
        "--preset",
        "flash",
        "--batch",
        "1",
        "--context",
        "4096",
        "--prefill",
        "0",
        "--repeat",
        "1",
        "--warmup",
        "1",
        "--profile",
        "--json",
        str(path),
    ]
    assert step.main(argv) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["projected_s"] > 0 and sum(run["breakdown"]["projected"].values()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("draft", ["0", "2"])
def test_graph_step_on_gpu(tmp_path, capsys, draft):  # noqa: ANN001
    # the decode step (and the verify step of 2 drafts) captured as CUDA graphs: device time
    # without the host's launch cost, so shorter than the eager step (every layer and the whole
    # step each captured)
    path = tmp_path / "graph.json"
    argv = ["--preset", "tiny", "--ops", "triton", "--batch", "1,4", "--context", "64",
            "--prefill", "0", "--repeat", "2", "--graph", "--draft-tokens", draft,
            "--json", str(path)]  # fmt: skip
    assert step.main(argv) == 0
    assert "decode step as CUDA graphs" in capsys.readouterr().out
    for run in json.loads(path.read_text())["runs"]:
        g = run["graph"]
        assert "error" not in g, g
        assert all(v["median_s"] > 0 for v in g["layers"].values())
        assert 0 < g["step"]["median_s"] < run["step"]["median_s"]
        assert 0 < g["projected_s"] < run["projected_s"]


def test_verify_step_of_draft_tokens(tmp_path, capsys):  # noqa: ANN001
    # speculative decoding's verify step: 1 + K tokens a sequence, against the floor of as many
    # tokens; tok/s counts one token a sequence
    path = tmp_path / "v.json"
    argv = BASE + ["--batch", "2", "--context", "40", "--prefill", "0", "--draft-tokens", "2",
                   "--json", str(path)]  # fmt: skip
    assert step.main(argv) == 0
    assert "verify steps (speculative decoding): 3 tokens a sequence" in capsys.readouterr().out
    res = json.loads(path.read_text())
    (run,) = res["runs"]
    assert run["tokens_per_seq"] == 3 and res["config"]["draft_tokens"] == 2
    # the floor of a plain step of 6 sequences whose new tokens make 43
    plain = tmp_path / "p.json"
    argv = BASE + ["--batch", "6", "--context", "42", "--prefill", "0", "--json", str(plain)]
    assert step.main(argv) == 0
    (six,) = json.loads(plain.read_text())["runs"]
    assert run["floor"]["floor_s"] == pytest.approx(six["floor"]["floor_s"])
    assert run["tok_per_s"] == pytest.approx(2 / run["projected_s"])
    with pytest.raises(SystemExit):
        step.main(BASE + ["--draft-tokens", "1", "--hf"])
    assert "no --hf" in capsys.readouterr().err


def test_prefill_chunk_at_context(tmp_path, capsys, monkeypatch):  # noqa: ANN001
    # one chunk of --chunk tokens of a sequence already holding each context; at 200 the CSA
    # tables of 8 tokens (200/4 entries each) pass a lowered ENTRY_TABLE_ELEMENTS: sliced
    from dsv4 import state

    monkeypatch.setattr(state, "ENTRY_TABLE_ELEMENTS", 128)
    path = tmp_path / "pc.json"
    argv = BASE + ["--batch", "1", "--context", "40", "--prefill", "0", "--chunk", "8",
                   "--prefill-context", "40,200", "--json", str(path)]  # fmt: skip
    assert step.main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    assert [(p["context"], p["tokens"]) for p in res["prefill_at"]] == [(40, 8), (200, 8)]
    for p in res["prefill_at"]:
        assert all(p["layers"][k]["median_s"] > 0 for k in ("sliding", "csa", "hca"))
        assert p["tok_per_s"] == pytest.approx(8 / p["projected_s"])
        assert f"prefill chunk of 8 tokens at context {p['context']}: " in out
    assert res["config"]["prefill_context"] == [40, 200]
    with pytest.raises(SystemExit):
        step.main(BASE + ["--prefill-context", "40", "--chunk", "0"])
    assert "give --chunk > 0" in capsys.readouterr().err


def test_graph_is_skipped_on_the_cpu(tmp_path):  # noqa: ANN001
    path = tmp_path / "g.json"
    argv = BASE + ["--batch", "1", "--context", "40", "--prefill", "0", "--graph",
                   "--json", str(path)]  # fmt: skip
    assert step.main(argv) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["graph"] == {"skipped": "CUDA graphs need a GPU"}


def test_trace_writes_a_profiler_trace(tmp_path):  # noqa: ANN001
    from dsv4.bench.step import main as step_main

    out = tmp_path / "b.json"
    argv = [
        "--preset",
        "tiny",
        "--batch",
        "1",
        "--context",
        "64",
        "--prefill",
        "0",
        "--repeat",
        "1",
    ]
    assert step_main([*argv, "--trace", str(tmp_path / "t.json"), "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    trace = json.loads(open(run["trace"]).read())
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])


def test_two_ranks(tmp_path, capfd):  # noqa: ANN001
    # -tp 2 starts two CPU ranks (gloo); each times its half of the step, rank 0 reports once
    path = tmp_path / "tp.json"
    argv = BASE + ["--batch", "2", "--context", "40", "--prefill", "8", "-tp", "2",
                   "--json", str(path)]  # fmt: skip
    assert step.main(argv) == 0
    res = json.loads(path.read_text())
    assert res["config"]["tensor_parallel_size"] == 2
    assert res["config"]["weight_dtype"] == "bf16"  # tiny parts: no whole FP8 blocks
    (run,) = res["runs"]
    assert run["projected_s"] > 0 and res["prefill"]["projected_s"] > 0
    assert capfd.readouterr().out.count("tensor parallel 2 (rank 0's times)") == 1


def test_layers_all_is_the_flash_schedule():
    layers = step._layer_list("all")
    f = flash_args()
    assert [k for k, _ in layers] == list(f.layer_types) and len(layers) == f.n_layers
    assert [m for _, m in layers] == list(f.mlp_layer_types)
    args, full = step.bench_args("flash", layers)
    keys = [step.layer_key(k, m) for k, m in layers]
    target = [step.layer_key(k, m) for k, m in zip(full.layer_types, full.mlp_layer_types)]
    plan = step.projection_plan(keys, target)  # every layer measured: nothing stands in
    assert not plan["substitutions"] and not plan["missing"] and args.n_layers == 43


def test_report_prints_the_prefill_breakdown(result, capsys):  # noqa: ANN001
    from dsv4.bench.report import print_report

    _, res = result
    print_report(res)
    out = capsys.readouterr().out
    assert "breakdown: prefill of 24 tokens in chunks of 16" in out
    assert "breakdown: batch 2, context 200" in out


def test_one_batch_prints_bench_one_batch_lines(tmp_path, capsys):  # noqa: ANN001
    # SGLang's bench_one_batch lines, as the scripts that scrape them read them, and its JSON
    import re

    from dsv4.bench import main as bench_main

    out = tmp_path / "r.jsonl"
    argv = ["one-batch", "--batch-size", "2", "--input-len", "8", "12", "--output-len", "5",
            "--json", str(out)]  # fmt: skip
    assert bench_main(argv) == 0
    text = capsys.readouterr().out
    prefill = re.findall(r"Prefill\. latency:\s+([\d.]+) s, throughput:\s+([\d.]+) token/s", text)
    decode = re.findall(
        r"Decode\.  median latency:\s+([\d.]+) s, median throughput:\s+([\d.]+)", text
    )
    total = re.findall(r"Total\. latency:\s+([\d.]+) s, throughput:\s+([\d.]+) token/s", text)
    assert len(prefill) == len(decode) == len(total) == 2
    assert len(re.findall(r"Decode \d\. Batch size: 2, latency", text)) == 2 * 4
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["input_len"]) for r in rows] == [(2, 8), (2, 12)]
    for r, (p_lat, p_tput) in zip(rows, prefill):
        assert r["decode_steps"] == 4  # the batch's prefill in one step gave the first tokens
        assert float(p_lat) == pytest.approx(r["prefill_latency"], abs=1e-5)
        assert float(p_tput) == pytest.approx(2 * r["input_len"] / r["prefill_latency"], rel=1e-3)
        assert r["total_latency"] >= r["prefill_latency"] + 4 * r["median_decode_latency"] * 0.5
    with pytest.raises(SystemExit):
        bench_main(["one-batch", "--output-len", "0"])
