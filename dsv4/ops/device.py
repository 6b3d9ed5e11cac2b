"""What the launchers ask of the device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device, interpreter: int = 4) -> int:
    """Streaming multiprocessors of a CUDA device. On the CPU (the Triton interpreter) `interpreter`
    stands in: small, so the tests exercise the launchers' split heuristics."""
    if device.type != "cuda":
        return interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count
