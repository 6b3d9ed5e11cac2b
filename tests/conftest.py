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
