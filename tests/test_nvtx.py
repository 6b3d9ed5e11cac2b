"""NVTX ranges a layer (SGLang's --enable-layerwise-nvtx-marker), checked on the CPU by recording
the range calls."""

from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.nvtx import mark_layers


def test_ranges_around_layers_attention_and_ffn(monkeypatch):  # noqa: ANN001
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(None))
    llm = LLM(device="cpu", progress=False, max_seqs=2, max_seq_len=64)
    handles = mark_layers(llm.model)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    n = llm.args.n_layers
    pushed = [c for c in calls if c is not None]
    assert pushed[:4] == ["embed", "layers.0", "layers.0.attn", "layers.0.ffn"]
    for i in range(n):
        assert f"layers.{i}.attn" in pushed and f"layers.{i}.ffn" in pushed
    depth = 0
    for c in calls:  # balanced: each push has its pop, never below zero
        depth += 1 if c is not None else -1
        assert depth >= 0
    assert depth == 0
    for h in handles:
        h.remove()
    calls.clear()
    llm.generate([[5, 6]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert calls == []  # the hooks are gone


def test_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(device="cpu", progress=False, enable_layerwise_nvtx_marker=True)
