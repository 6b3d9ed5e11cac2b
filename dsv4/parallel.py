"""Tensor and expert parallelism: which part of the model this process holds, and the collectives.

One process a rank. Rank 0 leads: its engine hands the other ranks its adds and aborts at every
step, and they repeat them and step with it (`Engine.tell`, `LLM._follow`), so every rank runs
the same model calls on the same inputs. `LLM(..., tensor_parallel_size=N)` starts ranks 1..N-1
itself (`start_followers`); under `torchrun` ranks > 0 follow inside `LLM()` and exit when rank 0
closes it. The parts:
- attention: each rank holds n_heads / world of the query heads (wq_b rows, attn_sink) and the
  output groups that read them (wo_a rows, wo_b columns); wo_b's partial sums are all-reduced.
  The single shared K=V head, the compressors and the indexer are replicated (like vLLM's).
- MoE: each rank holds n_routed / world consecutive routed experts (expert parallelism) and
  1 / world of the shared expert's inner dimension (w1 / w3 rows, w2 columns); the router is
  replicated; routed and shared partial sums are all-reduced together.
- embedding, hyper-connections, norms and head are replicated, so every rank computes the same
  logits; the sampled tokens are broadcast from rank 0 so that the ranks never diverge.

A single process is `Parallel()` (world_size 1): every collective is the identity.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ParallelError(ValueError):
    """A model or checkpoint that cannot be split over the asked-for ranks."""


@dataclass(frozen=True)
class Parallel:
    """Rank and size of the tensor/expert-parallel group (the default process group)."""

    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ParallelError(f"rank {self.rank} of world size {self.world_size}")

    # ---- the split ---------------------------------------------------------------------------
    def part(self, n: int, what: str) -> int:
        """This rank's share of n (n / world), with a clear error when n does not divide."""
        if n % self.world_size:
            raise ParallelError(
                f"{what} = {n} does not split over {self.world_size} ranks "
                f"(tensor/expert parallel size must divide it)"
            )
        return n // self.world_size

    def start(self, n: int, what: str) -> int:
        """First index of this rank's share of n."""
        return self.rank * self.part(n, what)

    # ---- collectives (identity on one rank) ------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in x.dtype. Added in fp32: bf16 partial sums are rounded
        once more than one process's GEMM rounds them, not once per rank. x itself may be
        overwritten; use the result."""
        if self.world_size == 1:
            return x
        import torch
        import torch.distributed

        y = x if x.dtype == torch.float32 else x.float()
        torch.distributed.all_reduce(y)
        return y.to(x.dtype)

    def least(self, n: int) -> int:
        """The smallest of the ranks' n (over the control channel, on the host)."""
        if self.world_size == 1:
            return n
        import torch
        import torch.distributed

        t = torch.tensor([n], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=_CONTROL)
        return int(t.item())

    def gather_errors(self, error: str | None) -> list[str | None]:
        """Every rank's error (None: it succeeded), in rank order, on every rank (over the
        control channel, on the host)."""
        if self.world_size == 1:
            return [error]
        import torch.distributed

        out: list[str | None] = [None] * self.world_size
        torch.distributed.all_gather_object(out, error, group=_CONTROL)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank, in place; returns x."""
        if self.world_size > 1:
            import torch.distributed

            torch.distributed.broadcast(x, src)
        return x


def from_env() -> Parallel:
    """The group `torchrun` (or `spawn`) describes in RANK / WORLD_SIZE; one rank without them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Parallel(world, int(os.environ.get("RANK", "0")))


def init(par: Parallel, device: str) -> str:
    """Join the process group of `par` (NCCL on CUDA, gloo on the CPU; rendezvous from
    MASTER_ADDR / MASTER_PORT) and return this rank's device: cuda:<local rank> for "cuda"."""
    import torch
    import torch.distributed

    if par.world_size == 1:
        return device
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", par.rank))
        if local >= torch.cuda.device_count():
            raise ParallelError(
                f"rank {par.rank} needs GPU {local}, but torch sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist = torch.distributed
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            rank=par.rank,
            world_size=par.world_size,
            device_id=torch.device(device) if dev.type == "cuda" else None,
        )
    elif dist.get_world_size() != par.world_size or dist.get_rank() != par.rank:
        raise ParallelError(
            f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"asked for rank {par.rank} of {par.world_size}"
        )
    global _CONTROL
    if _CONTROL is None:  # every rank creates it, in the same order
        _CONTROL = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return device


# The control channel: rank 0's engine commands to the other ranks of a server (gloo, on the
# host). It waits while the server idles, so its timeout is long.
CONTROL_TIMEOUT = timedelta(days=365)
_CONTROL = None


# what rank 0 tells the other ranks to do
COMMANDS = (
    "step",
    "score",
    "compile_graphs",
    "reload",
    "update",
    "sleep",
    "wake_up",
    "stop",
    "profile",
)


def send(what: str, payload: object = None) -> None:
    """Rank 0: tell every other rank's `receive` `what` (one of COMMANDS), with an optional
    picklable payload. One broadcast of two integers (the command, the payload's pickled size),
    then the pickled bytes if any: a plain decode step pays one small host collective."""
    import pickle

    import torch
    import torch.distributed

    data = b"" if payload is None else pickle.dumps(payload)
    head = torch.tensor([COMMANDS.index(what), len(data)], dtype=torch.int64)
    torch.distributed.broadcast(head, 0, group=_CONTROL)
    if data:
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        torch.distributed.broadcast(body, 0, group=_CONTROL)


def receive() -> tuple[str, object]:
    """Ranks > 0: the next (command, payload or None) rank 0 sends (blocks until it does)."""
    import pickle

    import torch
    import torch.distributed

    head = torch.zeros(2, dtype=torch.int64)
    torch.distributed.broadcast(head, 0, group=_CONTROL)
    what, size = COMMANDS[int(head[0])], int(head[1])
    if not size:
        return what, None
    body = torch.empty(size, dtype=torch.uint8)
    torch.distributed.broadcast(body, 0, group=_CONTROL)
    return what, pickle.loads(body.numpy().tobytes())  # rank 0's own objects (trusted)


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_followers(world_size: int, fn, *args) -> list:  # noqa: ANN001
    """Make this process rank 0 of world_size (RANK / WORLD_SIZE / MASTER_* set here) and start
    ranks 1..world_size-1 as local processes running fn(*args); returns them (join them after
    rank 0 has stopped them)."""
    import torch.multiprocessing as mp

    port = _free_port()
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args), daemon=False)
        for r in range(1, world_size)
    ]
    for p in procs:
        p.start()
    return procs


def ranks(size: int, fn, *args) -> tuple[Parallel, list]:  # noqa: ANN001
    """This process's place among `size` ranks, and the processes started for the others: alone
    for 1; under torchrun its RANK; else rank 0, with ranks 1.. started here running fn(*args)."""
    procs = []
    if size != 1 and "WORLD_SIZE" not in os.environ:
        procs = start_followers(size, fn, *args)
    par = from_env() if size != 1 else Parallel()
    if par.world_size != size:
        raise ParallelError(f"tensor_parallel_size={size}, but torchrun started {par.world_size}")
    return par, procs


log = logging.getLogger("dsv4")
_STOPPING = threading.Event()  # set by `stop`: the followers' exits from then on are asked for
WATCH_INTERVAL = 1.0  # seconds between the watchdog's looks at the followers


def _die(rank: int, code: int | None) -> None:
    log.error(
        "tensor parallel: rank %d exited (code %s) while rank 0 runs; stopping rank 0 too "
        "(its next collective would wait for rank %d forever)", rank, code, rank,
    )  # fmt: skip
    logging.shutdown()
    os._exit(1)


def watch(procs: list, on_death=None) -> threading.Thread:  # noqa: ANN001
    """Rank 0: a daemon thread that calls on_death(rank, exit code) -- by default `_die`: log it
    and end this process with code 1 -- when a follower started here (`start_followers`) fails
    (a nonzero code: an exception, a signal) before `stop` asks it to stop. Rank 0 would otherwise
    wait in its next collective for good. (vLLM's executor shuts down on a dead worker too; under
    torchrun its agent stops the other ranks.) A follower that ends with code 0 unasked was
    interrupted with rank 0 (Ctrl-C reaches every rank), which is stopping anyway."""
    _STOPPING.clear()

    def run() -> None:
        while not _STOPPING.wait(WATCH_INTERVAL):
            for r, p in enumerate(procs, start=1):
                if p.exitcode and not _STOPPING.is_set():
                    (on_death or _die)(r, p.exitcode)
                    return

    t = threading.Thread(target=run, name="dsv4-rank-watch", daemon=True)
    t.start()
    return t


def stop(procs: list, timeout: float = 60.0) -> None:
    """After rank 0 has told its followers to stop: leave the process group, then wait for them
    (and, if `procs` were started here, forget the group's environment). The ranks leave
    together: rank 0 does not wait for its followers to exit first, in case a communicator's
    teardown waits for the other ranks' teardown. (Drop the CUDA graphs that captured
    collectives before: NCCL's teardown waits for them, `Engine.close`.)"""
    import torch.distributed

    global _CONTROL
    _STOPPING.set()
    _CONTROL = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.terminate()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if procs:
            os.environ.pop(key, None)


def spawn(world_size: int, fn, *args) -> None:  # noqa: ANN001
    """Run fn(*args) on world_size local processes as ranks 0..world_size-1 (what `torchrun
    --nproc-per-node` does; `bench step -tp N` and the tests use it). Raises if a rank fails
    (torch.multiprocessing.ProcessRaisedException) or returns a nonzero code (...ExitedException)."""
    import torch.multiprocessing as mp

    port = _free_port()
    mp.spawn(_entry, args=(world_size, port, fn, args), nprocs=world_size, join=True)


def _entry(rank: int, world_size: int, port: int, fn, args: tuple) -> None:  # noqa: ANN001
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed

    global _CONTROL
    try:
        code = fn(*args)
        if code:
            raise SystemExit(code)
    finally:
        _CONTROL = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
