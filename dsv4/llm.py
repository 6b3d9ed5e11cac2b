"""Offline Python API: LLM(model_dir).score(token_ids) and a minimal batched greedy generate."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4 import ops as ops_pkg
from dsv4.checkpoint import has_mtp, load_checkpoint
from dsv4.config import EngineConfig, ModelArgs
from dsv4.model import Transformer
from dsv4.state import Batch, DecodeState


def demo_model_dir() -> Path:
    """The built-in demo model (random weights, real DeepSeek-V4 tokenizer), created on first use."""
    import os

    from dsv4.tiny import make_tiny, tiny_args

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4" / "demo-v1"
    if not (root / "model.safetensors.index.json").exists():
        tmp = root.with_name(root.name + ".tmp")
        make_tiny(tmp, tiny_args(), seed=0, tokenizer="deepseek")
        tmp.replace(root) if not root.exists() else None
    return root


@dataclass
class RequestOutput:
    """One finished request."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class LLM:
    """A loaded DeepSeek-V4 model with its decode state."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        quantized: bool = False,
        ops: str = "ref",
        max_seqs: int = 8,
        max_seq_len: int = 4096,
        progress: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else demo_model_dir()
        self.config = EngineConfig(
            device=device,
            dtype=dtype,
            ops=ops,
            quantized=quantized,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
        )
        args = ModelArgs.from_json(self.model_dir)
        if args.n_mtp_layers and not has_mtp(self.model_dir):
            args = args.replace(n_mtp_layers=0)  # MTP tensors are optional in a checkpoint
        self.args = args
        with torch.device(device):
            self.model = Transformer(args, self.config.torch_dtype, quantized, ops_pkg.select(ops))
        load_checkpoint(self.model, self.model_dir, progress=progress)
        self.model.eval()
        self.state = DecodeState(args, max_seqs, max_seq_len, self.config.torch_dtype, device)
        self.tokenizer = None
        if (self.model_dir / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))

    # ---- scoring -----------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced fp32 logits for every position: [T, vocab]. Chunked prefill if asked."""
        self._check_ids(token_ids)
        chunk = chunk_size or len(token_ids)
        out = []
        for start in range(0, len(token_ids), chunk):
            ids = token_ids[start : start + chunk]
            h = self._forward([0], [start], [ids])
            out.append(self.model.logits(h))
        return torch.cat(out)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.config.max_seq_len:
            raise ValueError(f"{len(ids)} tokens exceed max_seq_len={self.config.max_seq_len}")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.args.vocab_size}): {bad[:5]}")

    def _forward(self, slots: list[int], starts: list[int], ids: list[list[int]]) -> torch.Tensor:
        dev = self.config.device
        batch = Batch.build(slots, starts, [len(x) for x in ids], self.state)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=dev)
        return self.model(flat, batch, self.state)

    # ---- generation --------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
            return [self.args.bos_token_id] + self.tokenizer.encode(
                prompt, add_special_tokens=False
            ).ids
        return list(prompt)

    @torch.inference_mode()
    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        max_tokens: int = 16,
        ignore_eos: bool = False,
    ) -> list[RequestOutput]:
        """Greedy decoding of a batch: all prompts prefilled together, then batched decode steps."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        outs: list[RequestOutput] = []
        for start in range(0, len(prompts), self.config.max_seqs):
            outs += self._generate_group(
                prompts[start : start + self.config.max_seqs], max_tokens, ignore_eos
            )
        return outs

    def _generate_group(
        self, prompts: list, max_tokens: int, ignore_eos: bool
    ) -> list[RequestOutput]:
        reqs = [RequestOutput(self.encode(p)) for p in prompts]
        for r in reqs:
            self._check_ids(r.prompt_token_ids)
            if len(r.prompt_token_ids) + max_tokens > self.config.max_seq_len:
                raise ValueError(
                    f"prompt + max_tokens exceeds max_seq_len={self.config.max_seq_len}"
                )
        slots, starts = list(range(len(reqs))), [0] * len(reqs)
        ids = [r.prompt_token_ids for r in reqs]
        active = list(range(len(reqs)))
        while active and max_tokens > 0:
            h = self._forward(
                [slots[i] for i in active], [starts[i] for i in active], [ids[i] for i in active]
            )
            last = torch.cumsum(torch.tensor([len(ids[i]) for i in active]), 0) - 1
            next_ids = self.model.logits(h[last]).argmax(-1).tolist()
            still = []
            for i, t in zip(active, next_ids):
                r = reqs[i]
                starts[i] += len(ids[i])
                r.token_ids.append(t)
                ids[i] = [t]
                if t == self.args.eos_token_id and not ignore_eos:
                    r.finish_reason = "stop"
                elif len(r.token_ids) >= max_tokens:
                    r.finish_reason = "length"
                else:
                    still.append(i)
            active = still
        for r in reqs:
            if self.tokenizer is not None:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return reqs
