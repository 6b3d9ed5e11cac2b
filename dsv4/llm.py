"""Offline Python API: LLM(model_dir).generate(prompts, params) and .score(token_ids)."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from dsv4 import hf_names, parallel
from dsv4 import ops as ops_pkg
from dsv4.checkpoint import has_mtp, load_checkpoint, load_tensors
from dsv4.config import (
    AUTO_SEQ_LEN,
    EngineConfig,
    ModelArgs,
    check_memory_flags,
    check_sizes,
    resolve_engine,
    speculative_tokens,
)
from dsv4.engine import Engine, RequestOutput, check_prompt
from dsv4.model import Transformer
from dsv4.nvtx import mark_layers
from dsv4.sampling import SamplingParams
from dsv4.sleep import Released, check_tags, storages
from dsv4.state import (
    Batch,
    DecodeState,
    bytes_per_seq,
    bytes_per_token,
    context_table_bytes,
    default_block_size,
)

log = logging.getLogger("dsv4")

__all__ = ["LLM", "RequestOutput", "SamplingParams", "demo_model_dir"]


def demo_model_dir() -> Path:
    """The built-in demo model (random weights, real DeepSeek-V4 tokenizer), made on first use."""
    from dsv4.tiny import make_tiny, tiny_args

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4" / "demo-v1"
    if not (root / "model.safetensors.index.json").exists():
        tmp = root.with_name(root.name + ".tmp")
        make_tiny(tmp, tiny_args(), seed=0, tokenizer="deepseek")
        if not root.exists():
            tmp.replace(root)
    return root


def _checkpoint_args(model_dir: Path) -> ModelArgs:
    """The config of the checkpoint in model_dir (without the MTP layers if it has none: their
    tensors are optional in a checkpoint)."""
    args = ModelArgs.from_json(model_dir)
    if args.n_mtp_layers and not has_mtp(model_dir):
        args = args.replace(n_mtp_layers=0)
    return args


class LLM:
    """A loaded DeepSeek-V4 model with its decode state and continuous-batching engine."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        quantized: bool | None = None,
        ops: str = "auto",
        max_seqs: int = 8,
        max_seq_len: int = 4096,
        max_step_tokens: int = 2048,
        chunk_size: int | None = None,
        max_memory: int | None = None,
        max_total_tokens: int | None = None,
        memory_fraction: float | None = None,
        block_size: int | None = None,
        gpu_memory_utilization: float | None = None,
        cuda_graphs: bool | None = None,
        kv_cache_dtype: str = "auto",
        progress: bool = True,
        tensor_parallel_size: int = 1,
        speculative_config: dict | str | None = None,
        enable_prefix_caching: bool = True,
        prefix_snapshots: int | None = None,
        scheduling_policy: str = "fcfs",
        priority_preemption_threshold: int | None = None,
        enable_layerwise_nvtx_marker: bool = False,
    ) -> None:
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # one sequence's prefill chunk: by default the step budget, as vLLM's chunked prefill
        # gives one prompt the whole max_num_batched_tokens (a 4096-token prompt at Flash width
        # on an H200: 2 steps of 2048 took 517 ms, 8 of 512 1221 ms; docs/PERF.md)
        chunk_size = max_step_tokens if chunk_size is None else chunk_size
        check_sizes(  # (max_seq_len "auto": resolved in _load)
            max_seqs=max_seqs, max_seq_len=max_seq_len, chunk_size=chunk_size,
            max_step_tokens=max_step_tokens,
        )  # fmt: skip
        check_memory_flags(
            max_memory, memory_fraction, gpu_memory_utilization, max_total_tokens, max_seq_len
        )
        self.model_dir = Path(model_dir) if model_dir is not None else demo_model_dir()
        flags = resolve_engine(device, dtype, ops, quantized, cuda_graphs)
        # tensor/expert parallel: one process a rank. Ranks 1.. are started here (they run this
        # same constructor and follow) unless torchrun started every rank
        kwargs["model_dir"] = self.model_dir
        par, self._followers = parallel.ranks(tensor_parallel_size, _follower, kwargs)
        try:  # a failed start stops the ranks started here and leaves the group
            flags["device"] = parallel.init(par, flags["device"])  # cuda -> cuda:<local rank>
            self.config = c = EngineConfig(
                **flags,
                max_seqs=max_seqs,
                max_seq_len=max_seq_len,
                kv_cache_dtype=kv_cache_dtype,
                parallel=par,
                num_speculative_tokens=speculative_tokens(speculative_config),
                scheduling_policy=scheduling_policy,
                priority_preemption_threshold=priority_preemption_threshold,
            )
            log.info(
                "engine: %s%s",
                " ".join(f"{k}={v}" for k, v in flags.items()),
                f" rank={par.rank}/{par.world_size}" if par.world_size > 1 else "",
            )
            # prefix caching: snapshots of the rings at cached block boundaries, each the size
            # of a slot's fixed state (None: the default, `DecodeState.default_snapshots`)
            if enable_prefix_caching and prefix_snapshots is not None and prefix_snapshots < 1:
                raise ValueError(f"prefix_snapshots must be >= 1, got {prefix_snapshots}")
            snapshots = prefix_snapshots if enable_prefix_caching else 0
            budget = dict(max_memory=max_memory, memory_fraction=memory_fraction,
                          gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip
            if enable_layerwise_nvtx_marker and not c.device.startswith("cuda"):
                raise ValueError("enable_layerwise_nvtx_marker needs a CUDA device (NVTX)")
            self._load(c, progress, block_size, budget, max_step_tokens, chunk_size, snapshots,
                       max_total_tokens)  # fmt: skip
            if enable_layerwise_nvtx_marker:  # (SGLang's: ranges a layer for nsys)
                mark_layers(self.model)
        except BaseException:
            if self._followers:
                parallel.stop(self._followers, timeout=10)
            raise
        self._score_state: DecodeState | None = None
        self._released: dict[str, Released] = {}  # sleep mode: what is given back, by tag
        self._weights_dropped = False  # sleep(level=2): reload_weights before serving again
        self._host_copy: torch.Tensor | None = None  # the weights' host buffer, for the next sleep
        if self._followers:  # a follower that dies unasked stops this process (`parallel.watch`)
            parallel.watch(self._followers)
        if par.rank:  # a follower: serve rank 0 until it closes, then end this process
            self._follow()
            raise SystemExit(0)
        if par.world_size > 1:
            atexit.register(self.close)

    def _load(
        self,
        c: EngineConfig,
        progress: bool,
        block_size: int | None,
        budget: dict,
        max_step_tokens: int,
        chunk_size: int,
        snapshots: int | None = 0,
        max_total_tokens: int | None = None,
    ) -> None:
        """Model, weights, tokenizer, state pools and engine for config `c` (this rank's part);
        budget: `state_budget`'s keywords, read once the weights are loaded; snapshots: prefix
        caching's ring snapshots (0: no cache, None: the default count); max_total_tokens: a cap
        on the pages' tokens (SGLang's)."""
        max_seqs, max_seq_len, kv_cache_dtype, par = (
            c.max_seqs, c.max_seq_len, c.kv_cache_dtype, c.parallel
        )  # fmt: skip
        self.args = args = _checkpoint_args(self.model_dir)
        with torch.device(c.device):
            self.model = Transformer(args, c.torch_dtype, c.quantized, ops_pkg.select(c.ops), par)
        load_checkpoint(self.model, self.model_dir, progress=progress)
        self.model.eval()
        self.tokenizer = None
        if (self.model_dir / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        # ---- state pools: fixed part per slot, pages for the growing part
        tdt = self.config.torch_dtype
        block_size = block_size or default_block_size(args)
        # vLLM's profile run: under gpu_memory_utilization the activations' peak of the largest
        # step stays out of the state's budget
        self.activation_peak = 0
        if budget["gpu_memory_utilization"] is not None and c.device.startswith("cuda"):
            seq_limit = max_step_tokens if max_seq_len == AUTO_SEQ_LEN else max_seq_len - 1
            tokens = min(max_step_tokens, seq_limit)
            # (the profile runs at a fresh context; a chunk near max_seq_len also holds its
            # index tables: their estimate joins the reserve)
            longest = args.max_position_embeddings if max_seq_len == AUTO_SEQ_LEN else max_seq_len
            self.activation_peak = self._profile_activations(tokens) + context_table_bytes(
                args, tokens, longest
            )
        max_memory = state_budget(c.device, **budget, reserve=self.activation_peak)
        # speculative decoding: compressor rows for a verify step's own tokens
        k = c.num_speculative_tokens
        step_rows = max_seqs * (1 + k) if k else 0
        if snapshots is None:  # the same count on every rank (their schedulers agree)
            snapshots = par.least(DecodeState.default_snapshots(
                args, max_seqs, max_memory, tdt, kv_cache_dtype, step_rows
            ))  # fmt: skip
            if not snapshots:
                log.warning("prefix caching off: the memory budget leaves no room for a ring "
                            "snapshot (--prefix-snapshots N asks for N)")  # fmt: skip
        if max_memory is None and max_seq_len == AUTO_SEQ_LEN:  # (a page cap was given)
            num_blocks = -(-max_total_tokens // block_size)
        elif max_memory is None:  # every slot can reach max_seq_len
            num_blocks = max_seqs * -(-max_seq_len // block_size)
        else:
            num_blocks = DecodeState.blocks_for_budget(
                args, max_seqs, max_memory, tdt, block_size, kv_cache_dtype, snapshots, step_rows
            )
        if max_total_tokens is not None:
            num_blocks = min(num_blocks, -(-max_total_tokens // block_size))
        # every rank the same pages (free memory differs a little between GPUs): the ranks'
        # schedulers must make the same choices, preemptions included
        num_blocks = par.least(num_blocks)
        if max_seq_len == AUTO_SEQ_LEN:  # the longest one sequence's pages can hold
            max_seq_len = min(args.max_position_embeddings, num_blocks * block_size)
            self.config = c = dataclasses.replace(c, max_seq_len=max_seq_len)
            log.info(
                "max_seq_len auto: %s tokens (the state's %d pages of %d; the model's limit %s)",
                f"{max_seq_len:,}", num_blocks, block_size, f"{args.max_position_embeddings:,}",
            )  # fmt: skip
        # the scheduler hands out these pages (block tables start empty)
        self.state = DecodeState(
            args,
            max_seqs,
            max_seq_len,
            tdt,
            c.device,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_format=kv_cache_dtype,
            num_snapshots=snapshots,
            step_rows=step_rows,
        )
        log.info(
            "state: %.0f B/token (growing) + %d B/sequence (fixed); %d pages x %d tokens = "
            "%d tokens; %.1f MiB",
            bytes_per_token(args, tdt, kv_cache_dtype),
            bytes_per_seq(args, tdt, kv_cache_dtype),
            self.state.num_blocks,
            self.state.block_size,
            self.state.num_blocks * self.state.block_size,
            self.state.nbytes() / 2**20,
        )
        # vLLM's two capacity lines: the paged state's tokens, and how many requests of
        # max_seq_len tokens it holds at once (slots permitting)
        tokens = self.state.num_blocks * self.state.block_size
        per_request = -(-max_seq_len // self.state.block_size)
        log.info("KV cache size: %s tokens", f"{tokens:,}")
        log.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{max_seq_len:,}",
            min(max_seqs, self.state.num_blocks / per_request),
        )
        self.engine = Engine(
            self.model,
            self.state,
            self.tokenizer,
            max_running=max_seqs,
            max_step_tokens=max_step_tokens,
            chunk_size=chunk_size,
            cuda_graphs=c.cuda_graphs,
            num_speculative_tokens=c.num_speculative_tokens,
            enable_prefix_caching=snapshots > 0,
            scheduling_policy=c.scheduling_policy,
            priority_preemption_threshold=c.priority_preemption_threshold,
        )

    # ---- weights -------------------------------------------------------------------------------
    def reload_weights(self, model_dir: str | Path, held: bool = False) -> None:
        """Load another checkpoint of the same model into the loaded one, in place (CUDA graphs
        and state pools stay valid), and drop the cached prefixes computed with the old weights.
        Call it between engine steps with no request running, or with `held` ones (paused in
        place: they go on with the new weights over the state the old ones wrote, as SGLang's
        in-place pause). Under tensor/expert parallelism every rank loads its part, and succeeds
        or fails with the others. ValueError, with the old weights in place, for a different
        config or a malformed checkpoint; if the new one fails half way (on any rank) the old
        one is loaded again (and if that fails too, RuntimeError: the model is neither)."""
        self._check_writable(held)
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json")
        args = _checkpoint_args(path)
        differ = [
            f"{k} ({getattr(self.args, k)!r} -> {v!r})"
            for k, v in vars(args).items()
            if getattr(self.args, k) != v
        ]
        if differ:
            raise ValueError(f"{path}: another model's config: {', '.join(differ[:6])}")
        if self.engine.leads:  # the other ranks load their parts beside this one
            self.engine.tell("reload", str(path))
        self._reload_parts(path)

    def _check_writable(self, held: bool) -> None:
        # the weights may be written now: no request running (unless held by a pause), awake
        if self.engine.requests and not held:
            raise ValueError(f"{len(self.engine.requests)} requests are running")
        if "weights" in self._released:
            raise ValueError("the weights are asleep (LLM.sleep): wake_up(['weights']) first")

    def _reload_parts(self, path: Path) -> None:
        """Every rank: load this rank's part of `path`, then agree with the others (one failure
        anywhere puts the old checkpoint back everywhere); rank 0 raises what reload_weights
        says."""
        par = self.config.parallel

        def load(ckpt: Path) -> list[str | None]:
            try:
                load_checkpoint(self.model, ckpt, progress=False)
                error = None
            except Exception as e:  # noqa: BLE001  (reported by rank, then raised on rank 0)
                error = str(e) or type(e).__name__
            return par.gather_errors(error)

        def named(errors: list[str | None]) -> str:
            if par.world_size == 1:
                return next(e for e in errors if e)
            return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)

        failed = load(path)
        if any(failed):
            again = load(self.model_dir)
            self._weights_dropped = self._weights_dropped and any(again)
            self._refuse()
            if any(again):
                raise RuntimeError(
                    f"{path} failed ({named(failed)}) and reloading {self.model_dir} failed too "
                    f"({named(again)})"
                )
            raise ValueError(f"{path}: {named(failed)} (the weights of {self.model_dir} are back)")
        self.model_dir = path
        self._weights_dropped = False
        self._refuse()
        if par.rank == 0:  # (it tells the other ranks to flush before their next step)
            self.engine.flush_cache()

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], held: bool = False
    ) -> int:
        """Write some of the weights from memory (SGLang's Engine.update_weights_from_tensor; an
        RL trainer beside the engine): (name, tensor) pairs in the checkpoint's names and
        formats, a quantized weight with its scales or as one float [out, in] tensor quantized
        here (`checkpoint.load_tensors`), or in transformers' DeepseekV4 names (its
        `state_dict()`, stacked experts included: `dsv4.hf_names`). Everything is checked first: on any error nothing is
        written (ValueError naming it). Drops the cached prefixes; calls as reload_weights (no
        request running, or `held` ones). Under tensor/expert parallelism the tensors go to the
        other ranks through host memory and each rank writes its part. Returns the tensors
        written here."""
        self._check_writable(held)
        named = list(hf_names.native(named_tensors))
        if self.engine.leads:  # (torch.save: pickle cannot carry FP8 tensors in torch 2.13)
            buf = io.BytesIO()
            torch.save([(n, t.detach().cpu()) for n, t in named], buf)
            self.engine.tell("update", buf.getvalue())
        return self._update_parts(named)

    def _update_parts(self, named: list[tuple[str, torch.Tensor]]) -> int:
        par = self.config.parallel
        try:
            written, error = load_tensors(self.model, named), None
        except ValueError as e:  # (CheckpointError: nothing was written on any rank)
            written, error = [], str(e)
        errors = par.gather_errors(error)
        if any(errors):
            raise ValueError(next(e for e in errors if e))  # (every rank checks every tensor)
        self.model.ops.forget_params()
        if par.rank == 0:  # (it tells the other ranks to flush before their next step)
            self.engine.flush_cache()
        return len(written)

    # ---- sleep mode ----------------------------------------------------------------------------
    def sleep(self, level: int = 1, tags: list[str] | None = None) -> None:
        """Give back the memory of the weights and of the decode state (vLLM's LLM.sleep), for
        another process on the GPU in between (an RL trainer beside the engine). Level 1 keeps
        the weights in host memory (one buffer, kept after wake_up for the next sleep: pinning
        it is the slow part); level 2 drops them (`reload_weights` after `wake_up`, as a weight
        update does). The state's contents go, and with them the cached prefixes and the
        CUDA graphs (captured again after `wake_up`). tags: of "weights" and "kv_cache" (default
        both; SGLang's release_memory_occupation). No request may be running (waiting ones,
        e.g. retracted by a pause, hold no state); new ones are refused, and steps, until
        wake_up. Every rank under tensor parallelism."""
        tags = list(check_tags(tags))
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        running = len(self.engine.scheduler.running)
        if running:  # (waiting ones, retracted by a pause, hold no state)
            raise ValueError(f"{running} requests are running (abort or retract them first)")
        if self.engine.leads:  # every rank gives back its part
            self.engine.tell("sleep", level, tags)
        self._sleep(level, tags)

    def _sleep(self, level: int, tags: list[str]) -> None:
        if self.config.parallel.rank == 0:  # (it tells the other ranks to flush too)
            self.engine.flush_cache()  # the cached prefixes' state is going
        self.engine.drop_graphs()  # (they read the memory given back)
        if "weights" in tags and "weights" not in self._released:
            # level 2 drops the checkpoint's parameters; the buffers the model computed itself
            # (RoPE tables) are not reloaded, so they are always kept
            params = storages(self.model.parameters())
            buffers = storages(self.model.buffers())
            keep, drop = (params + buffers, []) if level == 1 else (buffers, params)
            self._released["weights"] = Released(keep, drop, host=self._host_copy)
            self._weights_dropped = level == 2
        if "kv_cache" in tags and "kv_cache" not in self._released:
            states = [self.state] + ([self._score_state] if self._score_state else [])
            self._released["kv_cache"] = Released(
                [], storages(t for st in states for t in st.tensors())
            )
        self._refuse()
        if torch.device(self.config.device).type == "cuda":
            gc.collect()  # (the graphs' memory pools go with the last reference to them)
            torch.cuda.empty_cache()
        log.info("asleep (level %d): %s released, %.1f GiB", level, ", ".join(self._released),
                 sum(r.nbytes for r in self._released.values()) / 2**30)  # fmt: skip

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory given back by `sleep` again (vLLM's LLM.wake_up; SGLang's
        resume_memory_occupation): the weights as they were (level 1) or to be reloaded (level
        2), the state zeroed. tags: of "weights" and "kv_cache" (default both): the weights first
        leave room for a weight update before the state comes back. Requests are served again
        once everything is back (and, after level 2, the weights reloaded)."""
        tags = list(check_tags(tags))
        if self.engine.leads:
            self.engine.tell("wake_up", tags)
        self._wake_up(tags)

    def _wake_up(self, tags: list[str]) -> None:
        for tag in tags:
            released = self._released.pop(tag, None)
            if released is not None:
                released.restore()
                if tag == "weights":  # (kept for the next sleep: pinning is the slow part)
                    self._host_copy = released.host
                self.model.ops.forget_params()  # (the storages lie elsewhere now)
        if not self._released:
            self.engine.make_graphs()
        self._refuse()

    @property
    def is_sleeping(self) -> bool:
        """Some memory is given back (vLLM's is_sleeping)."""
        return bool(self._released)

    @property
    def sleeping_tags(self) -> list[str]:
        """What is given back now, of "weights" and "kv_cache"."""
        return list(self._released)

    def _refuse(self) -> None:
        # why the engine refuses requests now, if it does
        if self._released:
            self.engine.asleep = (
                f"the engine is asleep ({', '.join(self._released)} released): wake_up first"
            )
        elif self._weights_dropped:
            self.engine.asleep = "the weights were dropped by sleep(level=2): reload them first"
        else:
            self.engine.asleep = None

    # ---- tensor parallel -----------------------------------------------------------------------
    def _follow(self) -> None:
        """Ranks > 0: repeat rank 0's adds and aborts, and each engine step, score call, weight
        reload or update, sleep and wake-up, in its order (`Engine.tell`), until it stops.
        Outputs stay here: rank 0 returns them."""
        log.info("rank %d: following rank 0", self.config.parallel.rank)
        while True:
            what, payload = parallel.receive()
            cmds, args = payload or ([], ())
            for kind, rid, *rest in cmds:
                if kind == "abort":
                    self.engine.abort(rid)
                elif kind == "flush":
                    self.engine.flush_cache()
                elif kind == "retract":
                    self.engine.retract()
                else:  # ("add", rid, prompt ids, params, priority)
                    prompt_ids, params, priority = rest
                    self.engine.add_request(prompt_ids, params, rid, priority)
            if what == "stop":
                self.engine.close()  # (its graphs)
                log.info("rank %d: stopped", self.config.parallel.rank)
                return
            try:
                if what == "step":
                    self.engine.step()
                elif what == "profile":
                    self.engine.follow_profile(*args)
                elif what == "compile_graphs":
                    self.engine.compile_graphs()
                elif what == "reload":
                    self._reload_parts(Path(*args))
                elif what == "update":
                    (data,) = args
                    self._update_parts(torch.load(io.BytesIO(data), weights_only=True))
                elif what == "sleep":
                    self._sleep(*args)
                elif what == "wake_up":
                    self._wake_up(*args)
                else:  # "score" (parallel.COMMANDS)
                    self.score(*args)
            except Exception:  # rank 0 fails the same call and aborts what it ran
                log.exception("rank %d: %s failed", self.config.parallel.rank, what)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (tensor parallel; idempotent)."""
        if self.engine.leads and not self.engine.closed:
            try:
                self.engine.close()
            except RuntimeError as e:  # a rank already gone (Ctrl-C reaches every rank)
                log.warning("tensor parallel: stopping the other ranks: %s", e)
            parallel.stop(self._followers)

    # ---- scoring -----------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced fp32 logits for every position: [T, vocab]. Chunked prefill if asked."""
        if self.engine.asleep:
            raise ValueError(self.engine.asleep)
        check_prompt(token_ids, self.args.vocab_size, self.config.max_seq_len, generate=False)
        if self.engine.leads:  # the other ranks run the same forward passes
            self.engine.tell("score", list(token_ids), chunk_size)
        chunk = chunk_size or len(token_ids)
        out = []
        for start in range(0, len(token_ids), chunk):
            h = self._forward([0], [start], [token_ids[start : start + chunk]])
            out.append(self.model.logits(h))
        return torch.cat(out)

    def _profile_activations(self, tokens: int) -> int:
        """The bytes one forward of `tokens` prompt tokens (the step budget as one sequence, the
        logits of its last) allocates at its peak beyond what is held before it and its own
        temporary state (vLLM's profile run). Every rank runs it, together."""
        c, dev = self.config, torch.device(self.config.device)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        state = DecodeState(self.args, 1, tokens + 1, c.torch_dtype, c.device,
                            kv_format=c.kv_cache_dtype)  # fmt: skip
        torch.cuda.reset_peak_memory_stats(dev)
        held = torch.cuda.memory_allocated(dev)
        with torch.inference_mode():
            batch = Batch.build([0], [0], [tokens], state)
            ids = torch.full((tokens,), min(5, self.args.vocab_size - 1), device=dev)
            h = self.model(ids, batch, state)
            self.model.logits(h[-1:])
        torch.cuda.synchronize(dev)
        top = torch.cuda.max_memory_allocated(dev)
        del state, batch, ids, h
        torch.cuda.empty_cache()
        # what stays allocated after it (workspaces made on first use) is counted as in use
        # when the budget reads the free memory: only the transient part is kept out here
        after = torch.cuda.memory_allocated(dev)
        peak = max(0, top - (held - before) - after)
        log.info("activations: %.2f GiB at the peak of a %d-token step (profiled; kept out of "
                 "the state's budget)", peak / 2**30, tokens)  # fmt: skip
        return peak

    def score_state(self) -> DecodeState:
        """Static-paged state used by score() (apart from the engine's pools)."""
        if self._score_state is None:
            with torch.inference_mode(False):  # normal tensors: usable inside and outside
                c = self.config
                self._score_state = DecodeState(
                    self.args,
                    c.max_seqs,
                    c.max_seq_len,
                    c.torch_dtype,
                    c.device,
                    kv_format=c.kv_cache_dtype,
                )
        return self._score_state

    def _forward(self, slots: list[int], starts: list[int], ids: list[list[int]]) -> torch.Tensor:
        state = self.score_state()
        batch = Batch.build(slots, starts, [len(x) for x in ids], state)
        flat = torch.tensor(
            [t for x in ids for t in x], dtype=torch.long, device=self.config.device
        )
        return self.model(flat, batch, state)

    # ---- generation --------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            return [self.args.bos_token_id] + ids
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        return self.engine.add_request(self.encode(prompt), params, request_id, priority)

    def warmup(self) -> float:
        """Meet the shapes a server meets first before it serves: a prefill step of every
        power-of-two token count up to the step budget and of one token more, then a short
        decode at every batch bucket up to max_seqs. On a GPU that compiles the Triton kernels'
        specializations and captures the decode graphs of the first position bound, so the first
        requests do not stall on them (vLLM's profile run and graph capture do the same). Steps
        longer than a chunk are several prompts admitted together, as concurrent requests are;
        the tile sizes that grow with a step's rows (rows per program of the norms and RoPE, the
        experts' row blocks, the router's token tiles) were the compiles a served burst still
        met when the warm-up stopped at one chunk (docs/PERF.md, 2026-12-01). Then each length
        again as a second chunk (after a first of a whole chunk: a prefix-cache hit's shapes),
        and with CUDA graphs every graph's step at every position bound, run once uncaptured
        (`Engine.compile_graphs`): the compiles a served burst met there (docs/PERF.md,
        2026-12-01, thirty-second session). The engine is left empty; returns the seconds it
        took."""
        t0 = time.perf_counter()
        s = self.engine.scheduler
        longest = min(s.max_step_tokens, self.config.max_seq_len - 2)
        per_prompt = min(s.chunk_size, longest)
        tok = min(5, self.args.vocab_size - 1)  # any valid id
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        k_max = longest.bit_length()
        lengths = sorted({min((1 << k) + e, longest) for k in range(k_max) for e in (0, 1)})
        for n in lengths:  # a first step of n tokens; past one chunk, prompts one token longer
            # than a chunk and the rest
            full, rest = divmod(n, per_prompt) if n > per_prompt else (0, n)
            prompts = [[tok] * (per_prompt + 1)] * full + ([[tok] * rest] if rest else [])
            if len(prompts) <= min(s.max_running, len(s.free_slots)):
                self.generate(prompts, one)
                self._forget()
        # a chunk after the first: n tokens at `per_prompt` cached or prefilled positions (a
        # prefix-cache hit, or a long prompt's second chunk): the attention's key counts and the
        # indexer's candidates there are not those of a first chunk of n tokens
        for n in lengths:
            if n <= per_prompt and per_prompt + n <= self.config.max_seq_len - 2:
                self.generate([[tok] * (per_prompt + n)], one)
                self._forget()
        k = min(4, s.max_running, len(s.free_slots))
        if per_prompt == longest and k > 1:  # (chunks as long as the budget: a step of the
            # whole budget over several prompts, as concurrent long prompts make, once)
            self.generate([[tok] * (longest // k)] * k, one)
            self._forget()
        top = 1 << (s.max_running - 1).bit_length()  # the largest bucket (DecodeGraphs pads up)
        batches = sorted({min(1 << k, s.max_running) for k in range(top.bit_length())})
        # (speculative decoding: long enough for a step that verifies all k drafts)
        n = 3 + self.engine.num_speculative_tokens
        decode = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for b in batches:  # prefill of b, then decode steps of b sequences
            self.generate([[tok] * 4] * b, decode)
            self._forget()
        # every graph's step at every position bound, eagerly: what a long generation meets
        # later (the indexer's tiles per context octave) compiles now
        steps = self.engine.compile_graphs()
        if self.tokenizer is not None:  # JSON mode's and structured outputs' token tables (~1 s
            # at 129K tokens), so the first such request does not stall the engine's steps
            _ = self.engine.json_grammar().all_tokens
        if s.cache is not None:  # its counters start with the served requests
            s.cache.queries = s.cache.hits = 0
        took = time.perf_counter() - t0
        log.info(
            "warm-up: prefills of %d lengths (1..%d), decodes of %s sequences, %d graph steps "
            "compiled, %.1f s",
            len(lengths), longest, batches, steps, took,
        )  # fmt: skip
        return took

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (OpenAI messages) or a list of them, rendered in
        the DeepSeek-V4 chat format (`dsv4.chat.encode_messages`; chat_template_kwargs:
        thinking, reasoning_effort, drop_thinking; add_generation_prompt and
        continue_final_message as vLLM's), then generated. The text comes back raw (thinking
        and DSML tool calls unparsed, as vLLM's offline chat)."""
        from dsv4.chat import THINK_END, encode_messages

        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: chat needs one")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kw = dict(chat_template_kwargs or {})
        bad = set(kw) - {"thinking", "reasoning_effort", "drop_thinking"}
        if bad:
            raise ValueError(f"chat_template_kwargs: unknown keys {sorted(bad)}")
        ids = [
            self.tokenizer.encode(
                encode_messages(
                    c,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **kw,
                ),
                add_special_tokens=False,
            ).ids
            for c in conversations
        ]
        if kw.get("thinking") and add_generation_prompt and not continue_final_message:
            # structured output constrains the answer after `</think>` (as the server does)
            end = self.tokenizer.token_to_id(THINK_END)
            if isinstance(params, SamplingParams):
                params = params.answer_after(end)
            elif params is not None:
                params = [p.answer_after(end) for p in params]
        return self.generate(ids, params, use_tqdm)

    def _forget(self) -> None:
        # warm-up: no prompt finds the last one's blocks (every rank drops them)
        if self.engine.scheduler.cache is not None:
            self.engine.flush_cache()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion with continuous batching; one
        RequestOutput per prompt (with n > 1 its `outputs` holds the n completions, as vLLM's).
        priority: one per prompt, under a priority scheduling policy (vLLM's argument)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        for pr in priority:  # (before any request is queued)
            self.engine.scheduler.check_priority(pr)
        ids = [
            [self.add_request(p, sp.choice(j), priority=pr) for j in range(sp.n)]
            for p, sp, pr in zip(prompts, params, priority)
        ]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=sum(map(len, ids)), desc="generating", unit="req")
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        outs = []
        for rids in ids:
            choices = [dataclasses.replace(done[r], index=j) for j, r in enumerate(rids)]
            first = choices[0]
            if len(choices) > 1:
                first = dataclasses.replace(first, choices=choices)
            outs.append(first)
        return outs


def state_budget(
    device: str,
    max_memory: int | None,
    memory_fraction: float | None,
    gpu_memory_utilization: float | None,
    reserve: int = 0,
) -> int | None:
    """The decode state's bytes from the one budget given (`config.check_memory_flags`), read
    after the weights are loaded: max_memory as it is, memory_fraction of what the device has
    free, gpu_memory_utilization by `utilization_budget` less `reserve` (the activations'
    profiled peak); None: no budget."""
    if memory_fraction is None and gpu_memory_utilization is None:
        return max_memory
    name = "memory_fraction" if memory_fraction is not None else "gpu_memory_utilization"
    if torch.device(device).type != "cuda":
        raise ValueError(f"{name} needs a CUDA device; use max_memory on the CPU")
    free, total = torch.cuda.mem_get_info(torch.device(device))
    if memory_fraction is not None:
        return int(free * memory_fraction)
    return utilization_budget(gpu_memory_utilization, free, total, reserve)


def utilization_budget(utilization: float, free: int, total: int, reserve: int = 0) -> int:
    """The state's bytes under gpu_memory_utilization: that fraction of the device's `total`
    less what it holds now (`total - free`: the weights, the CUDA context, other processes) and
    `reserve` (the activations' peak). ValueError when nothing is left."""
    budget = int(utilization * total) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {total / 2**30:.1f} GiB leaves no room for "
            f"the decode state: {(total - free) / 2**30:.1f} GiB are in use once the weights "
            f"are loaded and a step's activations take {reserve / 2**30:.1f} GiB; raise it, or "
            "give memory_fraction / max_memory"
        )
    return budget


def _follower(kwargs: dict) -> None:
    """Ranks 1.. of an `LLM(..., tensor_parallel_size=N)`: the same constructor, which follows."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        LLM(**kwargs)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; rank 0 reports it
        pass
