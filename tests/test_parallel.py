"""Tensor and expert parallelism: two CPU ranks (gloo) against one process on the same checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from dsv4 import LLM, SamplingParams, parallel
from dsv4.checkpoint import load_checkpoint
from dsv4.cli import main
from dsv4.model import Experts, Transformer
from dsv4.parallel import Parallel, ParallelError, spawn
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import ServerProcess

PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(50, 61))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
RANDOM = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))


def test_two_ranks_equal_one(model_dir: Path) -> None:
    # this process leads (rank 0); LLM() starts rank 1, which follows its steps and scores
    two = LLM(model_dir, device="cpu", tensor_parallel_size=2, progress=False, max_seqs=4,
              scheduling_policy="priority", priority_preemption_threshold=10)  # fmt: skip
    try:
        a = two.args
        assert two.config.parallel == Parallel(2, 0) and two._followers
        # this rank holds half the heads and the first half of the routed experts
        assert two.model.layers[0].attn.n_heads == a.n_heads // 2
        assert list(map(int, two.model.layers[1].ffn.experts._modules)) == list(range(4))
        logits = two.score(PROMPTS[0])
        greedy = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
        torch.manual_seed(1234)  # rank 1 draws from its own generator: rank 0's must decide
        drawn = [o.token_ids for o in two.generate(PROMPTS, RANDOM)]
        # rank 1 admits in rank 0's order (the slots and the batch order follow it) only if the
        # priorities reach it: the last prompt first
        ordered = [o.token_ids for o in two.generate(PROMPTS, GREEDY, priority=[5, 1, 0])]
        # four slots held by outranked requests: a later one preempts the newest on both ranks
        low = PROMPTS + PROMPTS[1:2]
        rids = [two.add_request(p, GREEDY, f"low{i}", priority=50) for i, p in enumerate(low)]
        two.engine.step()
        rids.append(two.add_request(PROMPTS[2], GREEDY, "high", priority=0))
        done = {}
        while two.engine.has_work():
            done |= {o.request_id: o.token_ids for o in two.engine.step() if o.finished}
        preempted = [done[r] for r in rids], two.engine.scheduler.num_preemptions
    finally:
        two.close()
    assert not any(p.is_alive() for p in two._followers)
    assert not torch.distributed.is_initialized()  # the group is left: another LLM may start
    one = LLM(model_dir, device="cpu", progress=False, max_seqs=4)
    # the same logits as one process (fp32; the ranks' partial sums only reorder the additions)
    torch.testing.assert_close(logits, one.score(PROMPTS[0]), rtol=1e-4, atol=1e-4)
    assert greedy == [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert ordered == greedy
    assert preempted == (greedy + greedy[1:3], 1)
    torch.manual_seed(1234)
    assert drawn == [o.token_ids for o in one.generate(PROMPTS, RANDOM)]


def _least_rank(out: Path) -> None:
    from dsv4 import parallel

    par = parallel.from_env()
    parallel.init(par, "cpu")
    (out / f"least{par.rank}").write_text(str(par.least(7 - 3 * par.rank)))


def test_ranks_agree_on_the_least(tmp_path: Path) -> None:
    # the state's page count: each rank's own budget, the smallest taken everywhere
    spawn(2, _least_rank, tmp_path)
    assert [(tmp_path / f"least{r}").read_text() for r in (0, 1)] == ["4", "4"]
    assert Parallel().least(9) == 9


def test_close_after_a_rank_is_gone(model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    # a rank killed first: the watchdog reports it (by default it would end this process, whose
    # next collective would wait for rank 1 for good), and closing still leaves the group
    died = []
    monkeypatch.setattr(parallel, "_die", lambda rank, code: died.append((rank, code)))
    monkeypatch.setattr(parallel, "WATCH_INTERVAL", 0.05)
    two = LLM(model_dir, device="cpu", tensor_parallel_size=2, progress=False, max_seqs=4)
    (follower,) = two._followers
    follower.kill()
    follower.join()
    for _ in range(100):
        if died:
            break
        time.sleep(0.05)
    assert died == [(1, -9)]
    two.close()
    assert two.engine.closed and not torch.distributed.is_initialized()


def test_watchdog_leaves_asked_and_interrupted_exits_alone() -> None:
    # no report once stop() has begun, nor for a follower that ended with code 0 (Ctrl-C)
    died = []
    procs = [SimpleNamespace(exitcode=None)]
    parallel.WATCH_INTERVAL, interval = 0.01, parallel.WATCH_INTERVAL
    try:
        t = parallel.watch(procs, lambda r, c: died.append((r, c)))
        procs[0].exitcode = 0
        time.sleep(0.1)
        assert t.is_alive() and not died
        parallel._STOPPING.set()
        procs[0].exitcode = 1
        t.join(1)
        assert not t.is_alive() and not died
    finally:
        parallel.WATCH_INTERVAL = interval


def test_a_dead_rank_ends_rank_0_with_a_message() -> None:
    # the default report: logged, and this process ends with code 1 (not a hang)
    r = subprocess.run(
        [sys.executable, "-c", "from dsv4.parallel import _die; _die(1, -9); print('alive')"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "alive" not in r.stdout
    assert "rank 1 exited (code -9)" in r.stderr


def test_split_errors(model_dir: Path) -> None:
    with pytest.raises(ParallelError, match="n_heads = 4 does not split over 3 ranks"):
        Transformer(tiny_args(vocab_size=300), par=Parallel(3, 0))
    with pytest.raises(ParallelError, match="rank 2 of world size 2"):
        Parallel(2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2, but torchrun started"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("WORLD_SIZE", "3")
            LLM(model_dir, device="cpu", tensor_parallel_size=2, progress=False)


def test_rank_loads_only_its_part(model_dir: Path) -> None:
    # built as rank 1 of 2 without a process group: the split parameters take their part of the
    # full tensors, the other rank's experts are never parameters here
    whole = Transformer(tiny_args(vocab_size=300))
    load_checkpoint(whole, model_dir, progress=False)
    half = Transformer(tiny_args(vocab_size=300), par=Parallel(2, 1))
    load_checkpoint(half, model_dir, progress=False)
    wa, ha = whole.layers[1].attn, half.layers[1].attn
    n = ha.wq_b.weight.shape[0]
    assert torch.equal(ha.wq_b.weight, wa.wq_b.weight[n:])
    assert torch.equal(ha.attn_sink, wa.attn_sink[wa.n_heads // 2 :])
    assert torch.equal(ha.wo_b.weight, wa.wo_b.weight[:, wa.wo_b.weight.shape[1] // 2 :])
    assert torch.equal(ha.wkv.weight, wa.wkv.weight)  # the shared K=V head is replicated
    we, he = whole.layers[1].ffn, half.layers[1].ffn
    assert isinstance(he.experts, Experts) and len(he.experts) == len(we.experts) // 2
    assert torch.equal(he.experts[0].w2.weight, we.experts[len(we.experts) // 2].w2.weight)
    i = he.shared_experts.w1.weight.shape[0]
    assert torch.equal(he.shared_experts.w1.weight, we.shared_experts.w1.weight[i:])
    assert torch.equal(he.shared_experts.w2.weight, we.shared_experts.w2.weight[:, i:])
    assert not any(".experts.0." in k for k in half.state_dict())
    with pytest.raises(IndexError):
        he.experts[len(he.experts)]


def test_two_ranks_reload_weights_and_sleep(tmp_path: Path) -> None:
    # another checkpoint loaded in place on both ranks (each its part): the outputs of a fresh
    # one-process load of it. A checkpoint whose only fault is in one of rank 1's experts loads
    # on rank 0 and fails on rank 1: the error names rank 1 and the tensor, and both ranks put the
    # old weights back (rank 0 had loaded another model's part: mixed, the outputs would differ)
    import shutil

    from safetensors.torch import load_file, save_file

    args = tiny_args(vocab_size=300)
    a, b = make_tiny(tmp_path / "a", args, seed=0), make_tiny(tmp_path / "b", args, seed=1)
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "layers.1.ffn.experts.7.w2.scale"  # expert 7 of 8: rank 1's (rank 0 checks its header)
    tensors[name] = tensors[name].clone()
    tensors[name].view(torch.uint8).fill_(0xFF)  # the UE8M0 NaN code
    save_file(tensors, shard, metadata={"format": "pt"})
    want_b = [o.token_ids for o in LLM(b, device="cpu", progress=False).generate(PROMPTS, GREEDY)]
    two = LLM(a, device="cpu", tensor_parallel_size=2, progress=False, max_seqs=4)
    try:
        first = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
        assert first != want_b
        two.reload_weights(b)
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want_b
        with pytest.raises(ValueError, match=r"rank 1: .*experts\.7\.w2\.scale") as e:
            two.reload_weights(bad)
        assert "rank 0" not in str(e.value) and "are back" in str(e.value)
        assert two.model_dir == b
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want_b
        two.reload_weights(a)
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == first
        # sleep mode on both ranks: the weights kept (level 1), or dropped and reloaded (level 2)
        two.sleep(level=1)
        two.wake_up()
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == first
        two.sleep(level=2)
        two.wake_up(["weights"])
        two.reload_weights(b)
        two.wake_up(["kv_cache"])
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want_b
        # a's tensors from memory: each rank writes its part (rank 1's experts through the
        # control channel); a bad batch is refused on every rank, nothing written
        ta = load_file(next(a.glob("*.safetensors")))
        with pytest.raises(ValueError, match="given twice"):
            two.update_weights_from_tensor([*ta.items(), ("embed.weight", ta["embed.weight"])])
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want_b
        two.update_weights_from_tensor(ta.items())
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == first
        # retracted mid-way on both ranks (state freed; a sleep in between), they recompute and
        # end as they would have
        rids = [two.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(3):
            two.engine.step()
        assert two.engine.retract() == len(PROMPTS)
        two.sleep()
        two.wake_up()
        done = {}
        while two.engine.has_work():
            done.update({o.request_id: o.token_ids for o in two.engine.step() if o.finished})
        assert [done[r] for r in rids] == first
    finally:
        two.close()


def test_generate_cli_two_ranks(model_dir: Path, capfd) -> None:  # noqa: ANN001
    # `dsv4 generate -tp 2` starts both ranks itself; rank 0 prints what one process prints
    flags = ["generate", "1 2 3", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "5"]
    assert main(flags) == 0
    one = capfd.readouterr().out
    assert main([*flags, "--tensor-parallel-size", "2"]) == 0
    two = capfd.readouterr().out
    assert one.strip() and two == one


def test_chat_cli_two_ranks(model_dir: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    lines = iter(["hi there", "again", ""])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    flags = ["chat", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "3"]
    assert main([*flags, "-tp", "2"]) == 0
    assert capsys.readouterr().out.count("assistant>") == 2
    assert not torch.distributed.is_initialized()  # closed: rank 1 stopped, the group left


def test_serve_two_ranks(model_dir: Path, tmp_path: Path) -> None:
    # rank 0 serves; rank 1 repeats its adds, aborts and steps. Concurrent greedy requests get
    # the tokens one process generates; a stream cut mid-way is aborted on both ranks, and the
    # server goes on serving; /update_weights_from_disk loads another checkpoint on both ranks
    one = LLM(model_dir, device="cpu", progress=False, max_seqs=4)
    want = [o.text for o in one.generate(PROMPTS, GREEDY)]
    other = make_tiny(tmp_path / "b", tiny_args(vocab_size=300), seed=1)
    want_other = LLM(other, device="cpu", progress=False).generate(PROMPTS[1], GREEDY)[0].text
    assert want_other != want[1]
    flags = ("--tensor-parallel-size", "2", "--max-seqs", "4", "--max-seq-len", "256")
    srv = ServerProcess(model_dir, tmp_path / "server.log", *flags)
    try:
        url = srv.url + "/v1/completions"
        body = {"model": model_dir.name, "max_tokens": 6, "temperature": 0, "ignore_eos": True}

        def ask(prompt: list[int]) -> dict:
            r = httpx.post(url, json={**body, "prompt": prompt}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, PROMPTS))
        assert [g["usage"]["completion_tokens"] for g in got] == [6, 6, 6]
        texts = [g["choices"][0]["text"] for g in got]
        assert texts == want
        with httpx.stream(
            "POST", url, json={**body, "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
        ) as r:
            next(r.iter_lines())  # cut after the first chunk: the request is aborted
        assert ask(PROMPTS[1])["choices"][0]["text"] == texts[1]
        # /start_profile traces every rank, under rank 0's id: num_steps ends them together;
        # /stop_profile ends a run with no count on both
        traces = tmp_path / "traces"
        r = httpx.post(srv.url + "/start_profile",
                       json={"output_dir": str(traces), "num_steps": 2}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        trace0 = Path(r.json()["trace"])
        ask(PROMPTS[2])
        trace1 = trace0.with_name(trace0.name.replace("-TP-0.", "-TP-1."))
        assert trace0.exists() and _eventually(trace1.exists), sorted(traces.iterdir())
        r = httpx.post(srv.url + "/start_profile", json={"output_dir": str(traces)}, timeout=60)
        ask(PROMPTS[0])
        stopped = httpx.post(srv.url + "/stop_profile", timeout=60)
        assert stopped.status_code == 200, stopped.text
        other0 = Path(stopped.json()["trace"])
        other1 = other0.with_name(other0.name.replace("-TP-0.", "-TP-1."))
        assert other0.exists() and _eventually(other1.exists) and other0 != trace0
        r = httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(other)},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json()["success"], r.text
        assert ask(PROMPTS[1])["choices"][0]["text"] == want_other
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert "rank=1/2" in log and "rank=0/2" in log
    assert "rank 1: following rank 0" in log and "rank 1: stopped" in log  # stopped by rank 0


def _eventually(ok, timeout: float = 20.0) -> bool:  # noqa: ANN001
    """Poll ok() until it holds (another process writes what it checks) or time runs out."""
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


# ---- two GPUs (NCCL): the fast path (bf16, Triton kernels, packed weights, CUDA graphs) -------

# tiny shapes whose halves are whole FP8 blocks: wq_b 2 heads x 64, wo_a / wo_b one group of 128,
# the shared expert 128 of 256
GPU_ARGS = dict(vocab_size=1024, head_dim=64, o_lora_rank=128, moe_inter_dim=256)
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


@pytest.mark.gpu
@two_gpus
def test_gpu_two_ranks(tmp_path: Path) -> None:
    model_dir = make_tiny(tmp_path / "m", tiny_args(**GPU_ARGS))
    kw = dict(tensor_parallel_size=2, progress=False, max_seqs=4, max_seq_len=512)
    two = LLM(model_dir, **kw)  # the GPU defaults: bf16, Triton, packed weights, CUDA graphs
    try:
        c = two.config
        assert c.device == "cuda:0" and c.cuda_graphs and c.quantized
        assert bool(torch.isfinite(two.score(PROMPTS[0])).all())
        assert all(len(o.token_ids) == 6 for o in two.generate(PROMPTS, GREEDY))
        assert two.engine.graphs.graphs and not two.engine.graphs.failed
    finally:
        two.close()
    # dropped before the group is left: NCCL's teardown waits for graphs holding its collectives
    assert two.engine.graphs is None
    # exact comparisons in fp32: in bf16 the extra rounding of the ranks' partial sums, or a
    # graph's padded batch, flips near-tied routing and top-k picks of a random tiny model
    # (checked on the CPU). Eager steps, graphs (of verify steps: MTP speculative decoding, rank
    # 0's drafts and verified tokens deciding on both ranks) and one GPU give the same tokens.
    # (Every rank must take the same path: a graph pads the batch to its bucket, so its
    # all-reduces are larger than an eager step's, and mixed ranks would wait for ever)
    eager = LLM(model_dir, dtype="float32", cuda_graphs=False, **kw)
    try:
        plain = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    finally:
        eager.close()
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    two = LLM(model_dir, dtype="float32", speculative_config=mtp, **kw)
    try:
        got = two.score(PROMPTS[0]).cpu()
        spec = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
        assert {q for _, _, q in two.engine.graphs.graphs} == {3}
    finally:
        two.close()
    one = LLM(model_dir, device="cuda:0", dtype="float32", progress=False, max_seqs=4)
    want = one.score(PROMPTS[0]).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    assert spec == plain == [o.token_ids for o in one.generate(PROMPTS, GREEDY)]


@pytest.mark.gpu
@two_gpus
def test_gpu_serve_two_ranks(tmp_path: Path) -> None:
    model_dir = make_tiny(tmp_path / "m", tiny_args(**GPU_ARGS))
    # fp32 (Triton kernels, packed weights, graphs): batched and one-at-a-time steps agree
    flags = ("--device", "cuda", "--dtype", "float32", "--tensor-parallel-size", "2",
             "--max-seqs", "4", "--max-seq-len", "512")  # fmt: skip
    srv = ServerProcess(model_dir, tmp_path / "server.log", *flags)
    try:
        url = srv.url + "/v1/completions"
        body = {"model": "m", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        def ask(prompt: list[int]) -> str:
            r = httpx.post(url, json={**body, "prompt": prompt}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            first = list(pool.map(ask, PROMPTS))
        assert [ask(p) for p in PROMPTS] == first  # one at a time = batched, graphs or not
    finally:
        srv.stop()
    assert "rank 1: stopped" in srv.log.read_text()


def test_failed_start_stops_the_ranks(tmp_path: Path) -> None:
    # no config.json: both ranks fail after joining the group; rank 0 stops rank 1, leaves the
    # group and forgets its environment, so a later LLM starts afresh
    with pytest.raises(ValueError, match="config file not found"):
        LLM(tmp_path, device="cpu", tensor_parallel_size=2, progress=False)
    assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
