from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter (must be set before triton is imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_engine_defaults(request, monkeypatch):  # noqa: ANN001, ANN202
    # the engine's "auto" flags take the GPU when torch sees one (dsv4.config.resolve_engine);
    # tests without the gpu marker test the CPU path on any machine (module-scoped fixtures,
    # set up before this, name device="cpu" themselves)
    if "gpu" not in request.keywords:
        monkeypatch.setattr("dsv4.config.cuda_available", lambda: False)
