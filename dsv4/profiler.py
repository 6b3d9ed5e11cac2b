"""The server's torch profiler over engine steps (`POST /start_profile`, `/stop_profile`, as vLLM
and SGLang serve them for their benchmarks' `--profile`).

Each Engine owns one (`Engine.profile`), on the engine thread: `AsyncEngine` hands it start and
stop requests through its inbox, and every `Engine.step` calls `step()`. A trace is one gzipped
Chrome trace per run, named `<id>-TP-<rank>.trace.json.gz` like SGLang's, under the directory
the request or `dsv4 serve --profile-dir` names. Opens in Perfetto or chrome://tracing. Under
tensor parallelism every rank writes its own trace, with rank 0's id: rank 0 tells the others to
start and stop (`Engine.follow_profile`), and they step alike, so they count the same steps.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


class ProfilerError(ValueError):
    """A start while profiling, a stop while not, or no directory to write to."""


class StepProfiler:
    """torch.profiler over a number of engine steps (or until stopped)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._prof: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._left: int | None = None  # steps until it stops by itself; None: until stop()
        self._wait = 0  # steps still to run before it starts (SGLang's start_step)
        self._acts: list = []
        self.trace_id: int | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    @property
    def pending(self) -> bool:
        """Started with a start_step that has not come yet."""
        return bool(self._wait)

    def start(
        self,
        output_dir: str | None,
        num_steps: int | None,
        cuda: bool,
        start_step: int = 0,
        trace_id: int | None = None,
    ) -> Path:
        """Start recording (after start_step more engine steps); returns the trace's path
        (written at stop). trace_id: the name's id (default: now in ms; the other ranks get
        rank 0's, `self.trace_id`)."""
        if self.active or self._wait:
            raise ProfilerError("the profiler is already running; POST /stop_profile first")
        if start_step < 0:
            raise ProfilerError(f"start_step must be >= 0, got {start_step}")
        if not output_dir:
            raise ProfilerError(
                "no directory for the trace: send output_dir, or start the server with "
                "--profile-dir DIR"
            )
        if num_steps is not None and num_steps < 1:
            raise ProfilerError(f"num_steps must be >= 1, got {num_steps}")
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            self._acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.trace_id = int(time.time() * 1e3) if trace_id is None else trace_id
        self._path = Path(output_dir) / f"{self.trace_id}-TP-{self.rank}.trace.json.gz"
        self._left, self._wait = num_steps, start_step
        if not start_step:
            self._begin()
        return self._path

    def _begin(self) -> None:
        self._prof = torch.profiler.profile(activities=self._acts)
        self._prof.start()

    def step(self) -> Path | None:
        """After an engine step: the trace's path if this step ended a num_steps run."""
        if self._wait:
            self._wait -= 1
            if not self._wait:
                self._begin()
            return None
        if self._left is None or not self.active:
            return None
        self._left -= 1
        return self.stop() if self._left == 0 else None

    def stop(self) -> Path:
        """Stop recording and write the trace; returns its path."""
        if self._wait:  # not begun: nothing recorded
            self._wait, self._path, self._left = 0, None, None
            raise ProfilerError("the profiler had not started yet (start_step): cancelled")
        if not self.active:
            raise ProfilerError("the profiler is not running; POST /start_profile first")
        prof, path = self._prof, self._path
        self._prof, self._path, self._left = None, None, None
        prof.stop()
        prof.export_chrome_trace(str(path))  # gzipped: the name ends in .gz
        return path
