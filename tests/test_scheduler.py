"""Scheduling policies: "fcfs" (arrival order) and "priority" (vLLM's: lower first, then arrival)
decide admission, the step budget's order and who is preempted; outputs do not change."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import ConfigError, ServerConfig
from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.state import bytes_per_seq, bytes_per_token
from dsv4.tiny import make_tiny, tiny_args

ARGS = tiny_args(vocab_size=300)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_tiny(tmp_path_factory.mktemp("sched"), ARGS, seed=3)


@pytest.fixture(scope="module")
def prompts():  # noqa: ANN201
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]


@pytest.fixture(scope="module")
def expected(ckpt, prompts):  # noqa: ANN001, ANN201
    llm = LLM(ckpt, progress=False, max_seqs=8, block_size=16)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _finish_order(llm: LLM, rids: list[str]) -> list[str]:
    done = []
    while llm.engine.has_work():
        done += [o.request_id for o in llm.engine.step() if o.finished]
    assert sorted(done) == sorted(rids)
    return done


def test_priority_decides_admission(ckpt, prompts, expected):  # noqa: ANN001
    # one running sequence at a time: requests finish in (priority, arrival) order, lower first,
    # and each gives the tokens it gives alone
    llm = LLM(ckpt, progress=False, max_seqs=1, block_size=16, scheduling_policy="priority")
    prio = [5, 0, 5, -1, 0]
    rids = [llm.add_request(p, GREEDY, f"r{i}", pr) for i, (p, pr) in enumerate(zip(prompts, prio))]
    assert _finish_order(llm, rids) == ["r3", "r1", "r4", "r0", "r2"]
    outs = llm.generate(prompts, GREEDY, priority=prio)
    assert [o.token_ids for o in outs] == expected  # (in prompt order, whatever ran first)
    # SGLang's default order: higher first, then arrival
    high = LLM(
        ckpt, progress=False, max_seqs=1, block_size=16, scheduling_policy="priority-high-first"
    )
    rids = [
        high.add_request(p, GREEDY, f"r{i}", pr) for i, (p, pr) in enumerate(zip(prompts, prio))
    ]
    assert _finish_order(high, rids) == ["r0", "r2", "r1", "r4", "r3"]
    # fcfs: arrival order
    fcfs = LLM(ckpt, progress=False, max_seqs=1, block_size=16)
    rids = [fcfs.add_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
    assert _finish_order(fcfs, rids) == rids


def test_priority_decides_who_is_preempted(ckpt, prompts, monkeypatch):  # noqa: ANN001
    # 3 pages beyond the slots' fixed state and two requests that each grow to 2 pages: one must
    # be preempted. fcfs preempts the newer; priority the lower-priority one although it came first
    per_page = int(bytes_per_token(ARGS, torch.float32) * 16)
    budget = 2 * bytes_per_seq(ARGS, torch.float32) + 3 * per_page
    long = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)  # 12 + 14 tokens: 2 pages
    pair = [prompts[3], prompts[3][:10] + [11, 12]]
    victims = {}
    for policy, prio in (("fcfs", [0, 0]), ("priority", [3, 1])):
        llm = LLM(ckpt, progress=False, max_seqs=2, max_memory=budget, block_size=16,
                  scheduling_policy=policy)  # fmt: skip
        assert llm.state.num_blocks == 3
        s = llm.engine.scheduler
        seen = victims[policy] = []
        preempt = s._preempt
        record = lambda r, p=preempt, v=seen: (v.append(r.request_id), p(r))  # noqa: E731
        monkeypatch.setattr(s, "_preempt", record)
        rids = [
            llm.add_request(p, long, f"{policy}{i}", pr)
            for i, (p, pr) in enumerate(zip(pair, prio))
        ]
        done = _finish_order(llm, rids)
        assert seen and set(seen) == {rids[1] if policy == "fcfs" else rids[0]}, seen
        assert done[0] == (rids[0] if policy == "fcfs" else rids[1])
        assert not llm.engine.requests and not s.running and not s.waiting
    again = LLM(ckpt, progress=False, max_seqs=2, block_size=16)
    want = [o.token_ids for o in again.generate(pair, long)]
    got = LLM(ckpt, progress=False, max_seqs=2, max_memory=budget, block_size=16,
              scheduling_policy="priority").generate(pair, long, priority=[3, 1])  # fmt: skip
    assert [o.token_ids for o in got] == want


def test_priority_needs_the_policy(ckpt, prompts):  # noqa: ANN001
    llm = LLM(ckpt, progress=False, max_seqs=2, block_size=16)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.add_request(prompts[0], GREEDY, priority=2)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(prompts[:2], GREEDY, priority=[0, 1])
    assert not llm.engine.has_work() and not llm.engine.requests  # nothing was queued
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts[:3], GREEDY, priority=[0, 0])
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        LLM(ckpt, progress=False, scheduling_policy="lifo")
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        ServerConfig(scheduling_policy="lifo")


def test_retract_keeps_the_priority_order(ckpt, prompts):  # noqa: ANN001
    # retracted requests wait again in the policy's order, ahead of or among the waiting ones
    llm = LLM(ckpt, progress=False, max_seqs=2, block_size=16, scheduling_policy="priority")
    rids = [
        llm.add_request(p, GREEDY, f"r{i}", pr) for i, (p, pr) in enumerate(zip(prompts, [4, 2, 3]))
    ]
    llm.engine.step()
    s = llm.engine.scheduler
    assert [r.request_id for r in s.running] == ["r1", "r2"]
    assert s.retract_all() == 2
    assert [r.request_id for r in s.waiting] == ["r1", "r2", "r0"]
    assert set(_finish_order(llm, rids)[:2]) == {"r1", "r2"}


def test_priority_orders_the_step_budget(ckpt, prompts):  # noqa: ANN001
    # 8 tokens a step, chunks of 6: the running request first in the policy's order takes its
    # chunk, the other the rest. r0 came first, r1 has the higher priority
    kw = dict(progress=False, max_seqs=2, block_size=16, max_step_tokens=8, chunk_size=6)
    llm = LLM(ckpt, scheduling_policy="priority", **kw)
    r0 = llm.add_request(prompts[3], GREEDY, "r0", 2)
    r1 = llm.add_request(prompts[3][::-1], GREEDY, "r1", 1)
    reqs = llm.engine.requests
    llm.engine.step()  # r1 admitted first: 6 tokens, r0 the other 2
    assert (reqs[r1].num_computed, reqs[r0].num_computed) == (6, 2)
    llm.engine.step()
    assert (reqs[r1].num_computed, reqs[r0].num_computed) == (12, 4)
    _finish_order(llm, [r0, r1])


def _running(llm: LLM) -> list[str]:
    return sorted(r.request_id for r in llm.engine.scheduler.running)


@pytest.mark.parametrize(
    ("policy", "low", "high"), [("priority", 50, 0), ("priority-high-first", 0, 50)]
)
def test_waiting_request_preempts_outranked(ckpt, prompts, expected, policy, low, high):  # noqa: ANN001
    # SGLang's preemption threshold: two slots held by outranked requests; a request that beats
    # them by more than the threshold takes the slot of the last in order (the newer), which
    # waits. Every request still gives the tokens it gives alone
    def run(threshold: int | None, beat: int) -> tuple[LLM, list[str]]:
        llm = LLM(ckpt, progress=False, max_seqs=2, block_size=16, scheduling_policy=policy,
                  priority_preemption_threshold=threshold)  # fmt: skip
        rids = [llm.add_request(prompts[i], GREEDY, f"r{i}", low) for i in range(2)]
        llm.engine.step()
        rids.append(llm.add_request(prompts[2], GREEDY, "r2", beat))
        llm.engine.step()
        return llm, rids

    by = high - low  # (the sign of "beats" under each policy)
    llm, rids = run(10, high)
    s = llm.engine.scheduler
    assert _running(llm) == ["r0", "r2"] and [r.request_id for r in s.waiting] == ["r1"]
    assert s.num_preemptions == 1
    outs = {}
    while llm.engine.has_work():
        outs |= {o.request_id: o.token_ids for o in llm.engine.step() if o.finished}
    assert [outs[r] for r in rids] == expected[:3]
    # beaten by the threshold exactly, or no threshold: nobody is preempted
    for threshold, beat in ((10, low + by // abs(by) * 10), (None, high), (0, low)):
        llm, _ = run(threshold, beat)
        assert _running(llm) == ["r0", "r1"], (threshold, beat)
        assert llm.engine.scheduler.num_preemptions == 0


def test_preemption_frees_pages_or_nothing(ckpt, prompts):  # noqa: ANN001
    # three pages and free slots: a waiting request short of pages preempts outranked running
    # ones until its first chunk fits; if all it outranks cannot free enough, nobody is preempted
    per_page = int(bytes_per_token(ARGS, torch.float32) * 16)
    budget = 3 * bytes_per_seq(ARGS, torch.float32) + 3 * per_page
    kw = dict(progress=False, max_seqs=3, max_memory=budget, block_size=16, chunk_size=48,
              scheduling_policy="priority", priority_preemption_threshold=10)  # fmt: skip
    one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # 12 + 4 tokens: 1 page
    llm = LLM(ckpt, **kw)
    s = llm.engine.scheduler
    assert s.state.num_blocks == 3
    for i, pr in enumerate((0, 50, 50)):  # one page each (12-token prompts)
        llm.add_request(prompts[3][: 12 - i], one, f"r{i}", pr)
    llm.engine.step()
    assert _running(llm) == ["r0", "r1", "r2"] and not s.free_pages
    long = (prompts[3] * 4)[:40]  # a 40-token prompt in one chunk: 3 pages
    llm.add_request(long, one, "big", 5)  # beats r1, r2 by 45, r0 not at all: 2 pages, not 3
    llm.engine.step()
    assert _running(llm) == ["r0", "r1", "r2"] and s.num_preemptions == 0
    assert [r.request_id for r in s.waiting] == ["big"]
    llm.engine.abort("big")
    llm.add_request(prompts[0], one, "small", 5)  # 5 tokens: one page, the newer r2's
    llm.engine.step()
    assert _running(llm) == ["r0", "r1", "small"] and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_threshold_needs_a_priority_policy(ckpt):  # noqa: ANN001
    with pytest.raises(ConfigError, match="needs a priority scheduling policy"):
        LLM(ckpt, progress=False, priority_preemption_threshold=10)
    with pytest.raises(ConfigError, match="must be >= 0"):
        ServerConfig(scheduling_policy="priority", priority_preemption_threshold=-1)


def test_preemption_counts_shared_pages_once(ckpt, prompts):  # noqa: ANN001
    # prefix caching: r1 shares r0's first block. Preempting r1 alone frees only its own page
    # (the shared one stays held by r0), so a request short of 2 pages preempts both
    bpt = bytes_per_token(ARGS, torch.float32)
    budget = 4 * bytes_per_seq(ARGS, torch.float32) + int(3 * 16 * bpt)  # 3 slots + 1 snapshot
    llm = LLM(ckpt, progress=False, max_seqs=3, max_memory=budget, block_size=16,
              prefix_snapshots=1, scheduling_policy="priority", priority_preemption_threshold=10)  # fmt: skip
    s = llm.engine.scheduler
    assert s.state.num_blocks == 3 and s.cache is not None
    four = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # 20 + 4 tokens: 2 pages
    shared = (prompts[3] * 2)[:16]
    llm.add_request(shared + [5, 6, 7, 8], four, "r0", 50)
    llm.engine.step()  # r0's first block is cached (snapshot at 16)
    llm.add_request(shared + [9, 10, 11, 12], four, "r1", 50)
    llm.engine.step()
    reqs = {r.request_id: r for r in s.running}
    assert reqs["r1"].num_cached == 16 and reqs["r1"].pages[0] == reqs["r0"].pages[0]
    assert not s.free_pages and s.cache.num_evictable == 0
    llm.add_request((prompts[1] * 3)[:20], four, "x", 0)  # 2 pages, no hit
    llm.engine.step()
    assert _running(llm) == ["x"] and s.num_preemptions == 2
    assert len(reqs := {r.request_id: r for r in s.running}) == 1 and len(reqs["x"].pages) == 2
    while llm.engine.has_work():
        llm.engine.step()
