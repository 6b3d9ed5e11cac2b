"""GPU smoke tests (skipped without CUDA): the same model on the GPU matches the CPU."""

from __future__ import annotations

import pytest
import torch

from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args
from tests.test_config import FAST, engine_flags

pytestmark = pytest.mark.gpu

# the exact path on the GPU (the engine's defaults there are bf16, Triton, packed weights, graphs)
FP32_REF = dict(dtype="float32", ops="ref", quantized=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_tiny(tmp_path_factory.mktemp("gpu"), tiny_args(vocab_size=300), tokenizer="bytes")


def test_cuda_fp32_matches_cpu(tiny):  # noqa: ANN001
    ids = list(range(2, 70))
    cpu = LLM(tiny, device="cpu", progress=False).score(ids)
    gpu = LLM(tiny, device="cuda", **FP32_REF, progress=False).score(ids).cpu()
    assert float((gpu - cpu).abs().max() / cpu.abs().max()) < 1e-3


def test_cuda_quantized_bf16_generates(tiny):  # noqa: ANN001
    llm = LLM(tiny, device="cuda", dtype="bfloat16", quantized=True, ops="ref", progress=False)
    ref = LLM(tiny, device="cpu", progress=False)
    ids = list(range(2, 40))
    a, b = llm.score(ids).cpu(), ref.score(ids)
    # bf16 activations through random layers: ~4% norm error on CPU too; same argmax almost always
    assert float((a - b).norm() / b.norm()) < 0.08
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    sp = SamplingParams(temperature=0.7, seed=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["hello", "a longer prompt"], sp)
    assert all(len(o.token_ids) == 8 for o in outs)


def test_cuda_triton_ops_match_reference(tiny):  # noqa: ANN001
    ids = list(range(2, 90))
    ref = LLM(tiny, device="cuda", **FP32_REF, progress=False).score(ids)
    kw = dict(dtype="float32", quantized=False, cuda_graphs=False, progress=False)
    tri = LLM(tiny, device="cuda", ops="triton", **kw).score(ids)
    assert float((tri - ref).abs().max() / ref.abs().max()) < 1e-3  # tf32 dots inside kernels
    err = {}  # bf16 + packed weights: the Triton backend no further from fp32 than the reference
    for ops in ("ref", "triton"):
        q = LLM(
            tiny,
            device="cuda",
            dtype="bfloat16",
            quantized=True,
            ops=ops,
            cuda_graphs=False,
            progress=False,
        )
        err[ops] = float((q.score(ids).float() - ref).norm() / ref.norm())
    assert err["ref"] < 0.15 and err["triton"] < 1.25 * err["ref"] + 0.01, err


def test_bf16_head_sums_in_fp32(tiny):  # noqa: ANN001
    # the bf16 head GEMM with fp32 output gives the fp32 product of the bf16 values (as the
    # upcast path does), whichever path this torch build takes
    import torch
    import torch.nn.functional as F

    llm = LLM(tiny, device="cuda", dtype="bfloat16", ops="ref", quantized=False, progress=False)
    x = torch.randn(5, llm.args.dim, device="cuda").to(torch.bfloat16)
    got = llm.model.head_logits(x)
    want = F.linear(x.double(), llm.model.head.weight.double()).float()
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_defaults_at_either_dtype_match_cpu(tiny, dtype):  # noqa: ANN001
    # the GPU defaults (Triton, packed weights, graphs) at a dtype the user picks: logits near the
    # CPU's exact path (fp32: tf32 dots; bf16 as test_cuda_quantized_bf16_generates), and the
    # graph-replayed greedy decode equals the eager one
    ids = list(range(2, 60))
    ref = LLM(tiny, device="cpu", progress=False).score(ids)
    llm = LLM(tiny, device="cuda", dtype=dtype, max_seqs=2, max_seq_len=256, progress=False)
    assert llm.config.cuda_graphs and llm.config.ops == "triton" and llm.config.quantized
    got = llm.score(ids).float().cpu()
    assert float((got - ref).norm() / ref.norm()) < (2e-3 if dtype == "float32" else 0.08)
    prompts = [list(range(3, 40)), list(range(9, 14))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    graphed = [o.token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    # the prefill step (42 tokens) replayed piecewise graphs
    assert llm.engine.pieces.graphs and not llm.engine.pieces.failed
    eager = LLM(
        tiny,
        device="cuda",
        dtype=dtype,
        max_seqs=2,
        max_seq_len=256,
        cuda_graphs=False,
        progress=False,
    )
    assert graphed == [o.token_ids for o in eager.generate(prompts, sp)]


def test_defaults_take_the_gpu_fast_path(tiny, caplog):  # noqa: ANN001
    # as vLLM: with a GPU in sight, LLM() and the CLI take bf16, the Triton kernels, packed
    # weights and CUDA graphs; the replayed decode gives the eager engine's greedy tokens
    import logging

    from dsv4.cli import main

    llm = LLM(tiny, max_seqs=2, max_seq_len=256, progress=False)
    assert engine_flags(llm.config) == FAST
    prompts = [list(range(2, 30)), list(range(5, 12))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphed = [o.token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    assert llm.engine.pieces.graphs and not llm.engine.pieces.failed  # the prefill step's
    eager = LLM(tiny, max_seqs=2, max_seq_len=256, cuda_graphs=False, progress=False)
    assert eager.engine.graphs is None and eager.engine.pieces is None
    assert graphed == [o.token_ids for o in eager.generate(prompts, sp)]
    with caplog.at_level(logging.INFO, logger="dsv4"):
        assert main(["generate", "hi", "--model", str(tiny), "--max-tokens", "3"]) == 0
    assert "device=cuda dtype=bfloat16 ops=triton quantized=True cuda_graphs=True" in caplog.text


def test_gpu_json_mode(tiny):  # noqa: ANN001
    # JSON mode on the GPU defaults (graph-replayed decode, masks moved to the device each step):
    # the outputs stay JSON-object prefixes, and greedy tokens equal the CPU's constrained run
    from dsv4 import grammar

    prompts = [list(range(3, 40)), list(range(9, 14))]
    sp = SamplingParams(temperature=0, max_tokens=16, json_object=True)
    llm = LLM(tiny, device="cuda", dtype="float32", max_seqs=2, max_seq_len=256, progress=False)
    outs = llm.generate(prompts, sp)
    tokens = llm.engine.json_grammar().tokens
    for o in outs:
        text = b"".join(tokens[i] or b"?" for i in o.token_ids)
        assert grammar.advance((grammar.START, ()), text) is not None, text
    cpu = LLM(tiny, device="cpu", progress=False).generate(prompts, sp)
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs, cpu))
    assert same >= 1  # (tf32 logits may flip a near-tie in one of them)


def test_gpu_json_schema(tiny):  # noqa: ANN001
    # structured outputs on the GPU defaults: outputs stay prefixes of the schema's instances, a
    # choice is finished, and greedy tokens equal the CPU's constrained run
    from dsv4.json_schema import compile_schema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
              "required": ["n", "s"]}  # fmt: skip
    prompts = [list(range(3, 40)), list(range(9, 14))]
    sp = SamplingParams(temperature=0, max_tokens=16, json_schema=schema)
    llm = LLM(tiny, device="cuda", dtype="float32", max_seqs=2, max_seq_len=256, progress=False)
    outs = llm.generate(prompts, sp)
    tokens, auto = llm.engine.json_grammar().tokens, compile_schema(schema)
    for o in outs:
        text = b"".join(tokens[i] or b"?" for i in o.token_ids)
        assert auto.advance(auto.START, text) != 0, text
    pick = SamplingParams(temperature=1.0, seed=2, max_tokens=8, guided_choice=["yes", "no"])
    assert all(o.text in ("yes", "no") for o in llm.generate(prompts, pick))
    cpu = LLM(tiny, device="cpu", progress=False).generate(prompts, sp)
    assert sum(a.token_ids == b.token_ids for a, b in zip(outs, cpu)) >= 1


def _served_and_other(tiny, tmp_path):  # noqa: ANN001, ANN202
    # the GPU defaults on `tiny` with graphs captured, another checkpoint of the same model, and
    # the greedy tokens of each: (llm, gen, other, first, want)
    other = make_tiny(tmp_path / "b", tiny_args(vocab_size=300), seed=1, tokenizer="bytes")
    prompts = [list(range(2, 30)), list(range(5, 12))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny, max_seqs=2, max_seq_len=256, progress=False)

    def gen() -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, sp)]

    first = gen()
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    fresh = LLM(other, max_seqs=2, max_seq_len=256, progress=False)
    want = [o.token_ids for o in fresh.generate(prompts, sp)]
    assert want != first
    return llm, gen, other, first, want


def test_gpu_reload_weights_under_graphs(tiny, tmp_path):  # noqa: ANN001
    # weights reloaded in place on the GPU defaults (packed weights, joined projections, captured
    # decode and prefill graphs): the replayed steps read the new weights (a fresh load's greedy
    # tokens), and the first ones again after reloading the first checkpoint
    llm, gen, other, first, want = _served_and_other(tiny, tmp_path)
    llm.reload_weights(other)
    assert gen() == want
    llm.reload_weights(tiny)
    assert gen() == first


def test_gpu_sleep_and_wake_up(tiny):  # noqa: ANN001
    # sleep mode on the GPU defaults: the memory of the weights and the state is freed (and the
    # caching allocator's free segments go back to the driver), the graphs go and are captured again
    # after wake_up (the same greedy tokens, every decode step from a graph); level 2 drops the
    # weights, which a reload brings back
    prompts = [list(range(2, 30)), list(range(5, 12))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny, max_seqs=2, max_seq_len=256, progress=False)
    first = [o.token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    weights = sum(p.nbytes for p in llm.model.parameters())
    state = llm.state.nbytes()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    llm.sleep(level=1)
    assert llm.engine.graphs is None
    assert allocated - torch.cuda.memory_allocated() >= weights + state
    assert torch.cuda.memory_reserved() < reserved
    llm.wake_up()
    assert [o.token_ids for o in llm.generate(prompts, sp)] == first
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    llm.sleep(level=2)
    llm.wake_up()
    llm.reload_weights(tiny)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == first


def test_gpu_update_weights_from_tensor_under_graphs(tiny, tmp_path):  # noqa: ANN001
    # another checkpoint's tensors from memory (on the GPU, as a trainer holds them) written into
    # the GPU defaults' packed and joined weights under captured graphs: a fresh load's greedy
    # tokens; one FP8 weight given as a float tensor is quantized on the GPU
    from safetensors.torch import load_file

    llm, gen, other, first, want = _served_and_other(tiny, tmp_path)
    tb = {k: v.cuda() for k, v in load_file(next(other.glob("*.safetensors"))).items()}
    llm.update_weights_from_tensor(tb.items())
    assert gen() == want
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed
    ta = load_file(next(tiny.glob("*.safetensors")))
    llm.update_weights_from_tensor(ta.items())
    assert gen() == first
    w = torch.randn(32, 64, device="cuda")
    llm.update_weights_from_tensor([("layers.0.attn.wq_a.weight", w)])
    from dsv4 import quant

    codes, scale = quant.quant_fp8(w)
    got = llm.model.layers[0].attn.wq_a
    assert torch.equal(got.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.uint8), scale.view(torch.uint8))


def test_gpu_memory_utilization(tiny, monkeypatch):  # noqa: ANN001
    # vLLM's gpu_memory_utilization: the state gets that fraction of the device less what the
    # device holds once the weights are loaded (as mem_get_info reads it then); the pages follow
    import dsv4.llm as llm_mod

    seen = []
    real = llm_mod.utilization_budget

    def spy(u, free, total, reserve=0):  # noqa: ANN001, ANN202
        seen.append((u, free, total, reserve))
        return real(u, free, total, reserve)

    monkeypatch.setattr(llm_mod, "utilization_budget", spy)
    kw = dict(progress=False, max_seqs=4, max_seq_len=256, cuda_graphs=False)
    import gc

    gc.collect()  # (earlier tests' engines freed now, not while this one loads)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    # ~1 GiB past what the device holds now, less what the weights and a step take
    used = total - torch.cuda.mem_get_info()[0]
    small = (used + (1 << 30)) / total
    llm = LLM(tiny, gpu_memory_utilization=small, **kw)
    ((u, free, t, reserve),) = seen
    # (vLLM's profile run: the activations' peak of a step stays out of the budget)
    assert reserve == llm.activation_peak > 0
    budget = int(u * t) - (t - free) - reserve
    assert 0 < budget and llm.state.nbytes() <= budget, (budget, llm.state.nbytes())
    same = LLM(tiny, max_memory=budget, **kw)  # the same budget given in bytes: the same pages
    assert same.state.num_blocks == llm.state.num_blocks
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(["hi", "there"], sp)] == [
        o.token_ids for o in same.generate(["hi", "there"], sp)
    ]
    with pytest.raises(ValueError, match="leaves no room for the decode state"):
        LLM(tiny, gpu_memory_utilization=max(used / total / 2, 0.001), **kw)


def test_gpu_max_seq_len_auto_and_nvtx_marker(tiny):  # noqa: ANN001
    # --max-model-len auto under --gpu-memory-utilization: the longest sequence the state's
    # pages hold, at most the model's limit; the NVTX ranges a layer on the GPU defaults (CUDA
    # graphs, Triton kernels) change no token
    from dsv4.config import AUTO_SEQ_LEN

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    auto = LLM(tiny, max_seq_len=AUTO_SEQ_LEN, gpu_memory_utilization=0.5, max_seqs=4,
               progress=False, enable_layerwise_nvtx_marker=True)  # fmt: skip
    s = auto.state
    assert auto.config.max_seq_len == min(auto.args.max_position_embeddings,
                                          s.num_blocks * s.block_size)  # fmt: skip
    assert auto.config.max_seq_len > 4096
    plain = LLM(tiny, max_seqs=4, progress=False)
    assert [o.token_ids for o in auto.generate([[5, 6, 7]], sp)] == [
        o.token_ids for o in plain.generate([[5, 6, 7]], sp)
    ]
