"""dsv4: an inference engine for DeepSeek-V4 models."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "ModelArgs", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy imports keep `import dsv4` light
    if name == "LLM":
        from dsv4.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsv4.sampling import SamplingParams

        return SamplingParams
    if name == "ModelArgs":
        from dsv4.config import ModelArgs

        return ModelArgs
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
