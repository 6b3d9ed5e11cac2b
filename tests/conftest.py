from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
