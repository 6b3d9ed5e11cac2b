"""Prefix caching: a request that starts from a cached prefix (shared pages, the rings' snapshot)
gives what it gives without the cache, for every attention kind, with speculative decoding, FP8
state, under page pressure, on two ranks and past generated tokens; and the cache's
bookkeeping."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.prefix_cache import PrefixCache
from dsv4.state import DecodeState, bytes_per_seq, bytes_per_token
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import in_process

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
# blocks of 16 tokens (the tiny model's ratios 4 and 16, window 8), prefill chunks of 32: the
# rings are snapshotted every two blocks and where a prompt's last chunk is cut (its last block
# boundary before the last token)
KW = dict(device="cpu", progress=False, max_seqs=3, chunk_size=32, block_size=16)


def _prompts() -> list[list[int]]:
    # three that share 40 tokens (two blocks and a half), one of them twice, and one stranger
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 300, (40,), generator=g).tolist()
    tail = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (30, 9, 21)]
    return [shared + tail[0], shared + tail[1], shared + tail[0], tail[2], shared[:33] + tail[1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> list:
    # each prompt alone, no cache: the reference outputs
    llm = LLM(model_dir, enable_prefix_caching=False, **KW)
    return [llm.generate(p, GREEDY)[0] for p in _prompts()]


def _one_by_one(llm: LLM) -> list:
    return [llm.generate(p, GREEDY)[0] for p in _prompts()]


def _same(outs: list, want: list) -> None:
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids
        got = torch.tensor([e["logprob"] for e in o.logprobs])
        torch.testing.assert_close(got, torch.tensor([e["logprob"] for e in w.logprobs]))


def test_hits_give_the_outputs_without_cache(model_dir: Path, plain: list) -> None:
    llm = LLM(model_dir, enable_prefix_caching=True, **KW)
    outs = _one_by_one(llm)
    _same(outs, plain)
    s = llm.engine.stats()
    # hits: prompt 2 the 32 shared tokens (2 blocks, snapshot at 32), prompt 3 (= prompt 1, 70
    # tokens) 64 (its last boundary), prompt 5 (33 shared) 32; prompts 1 and 4 nothing
    lens = [len(p) for p in _prompts()]
    assert s.prefix_cache_queries == sum(lens)
    assert s.prefix_cache_hits == 32 + 64 + 32
    # nothing held after the requests; the cached pages count as free
    assert s.num_free_pages == s.num_pages
    assert llm.engine.scheduler.cache.num_evictable == len(llm.engine.scheduler.cache.blocks)


def test_without_the_snapshot_the_outputs_differ(model_dir: Path, plain: list) -> None:
    # the check above can fail: starting from the shared pages with the rings of whatever the
    # slot held before gives other outputs
    llm = LLM(model_dir, enable_prefix_caching=True, **KW)
    llm.state.load_snapshot = lambda i, slot: None
    outs = _one_by_one(llm)
    assert any(o.token_ids != w.token_ids or o.logprobs != w.logprobs for o, w in zip(outs, plain))


@pytest.mark.parametrize("chunk", [32, 128])
def test_batched_hits_and_chunks(model_dir: Path, plain: list, chunk: int) -> None:
    # all at once: later requests of one batch find what the first ones cached in earlier steps
    # (or, prefilled side by side, keep their own pages: the second block stays private).
    # Chunks of 128 with a step of 256: several snapshots written inside one step's chunks
    step = 40 if chunk == 32 else 256
    llm = LLM(
        model_dir, enable_prefix_caching=True, max_step_tokens=step, **(KW | {"chunk_size": chunk})
    )
    prompts = _prompts()
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    _same(first + rest, plain)
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_state_and_speculative_decoding(model_dir: Path, kv: str) -> None:
    # the snapshot holds FP8 window rows, and the MTP layer's ring (its drafts read it)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = dict(KW, kv_cache_dtype=kv, speculative_config=spec)
    want = _one_by_one(LLM(model_dir, enable_prefix_caching=False, **kw))
    llm = LLM(model_dir, enable_prefix_caching=True, **kw)
    _same(_one_by_one(llm), want)
    assert llm.engine.stats().prefix_cache_hits == 32 + 64 + 32
    # drafts identical too: the same drafts accepted
    assert llm.engine.stats().num_draft_tokens > 0


@pytest.mark.parametrize("chunk", [32, 128])
def test_page_pressure_evicts_before_preempting(model_dir: Path, plain: list, chunk: int) -> None:
    # a pool of 6 pages (a request of 70 + 6 tokens needs 5): cached blocks are dropped, least
    # recently used leaves first, before any request is preempted, and snapshots recycled
    # (chunks of 128: snapshots written inside chunks)
    args, snaps = tiny_args(vocab_size=300), 3
    fixed = (KW["max_seqs"] + snaps) * bytes_per_seq(args, torch.float32)  # slots + snapshots
    page = bytes_per_token(args, torch.float32) * KW["block_size"]
    kw = dict(KW, max_memory=int(fixed + 6.5 * page), chunk_size=chunk)
    g = torch.Generator().manual_seed(1)
    strangers = [torch.randint(1, 300, (60,), generator=g).tolist() for _ in range(3)]
    want = LLM(model_dir, enable_prefix_caching=False, **kw).generate(strangers, GREEDY)
    llm = LLM(model_dir, enable_prefix_caching=True, prefix_snapshots=snaps, **kw)
    assert llm.config.torch_dtype == torch.float32 and llm.state.num_blocks == 6
    outs = _one_by_one(llm)
    others = [llm.generate(p, GREEDY)[0] for p in strangers]
    _same(outs + others + _one_by_one(llm), plain + want + plain)
    cache = llm.engine.scheduler.cache
    assert llm.engine.stats().num_preemptions == 0 and llm.engine.stats().prefix_cache_hits > 0
    assert next(cache._ids) > 7  # more blocks were cached than there are pages: some evicted
    assert len(cache.free_snapshots) + len(cache.with_snapshot) == snaps


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_snapshot_inside_a_chunk_is_the_one_at_its_end(model_dir: Path, kv: str) -> None:
    # a 70-token prompt in one chunk of 128 is not cut at its last block boundary (64): the model
    # writes the rings there into the snapshot as it runs (the window rows before the chunk, the
    # chunk's own, the compressors' open windows, the MTP layer's ring). They equal the snapshot
    # a chunk ending at 64 leaves, and a prompt that goes on differently from 64 starts there
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = _prompts()[0]
    snaps, steps = {}, {}
    for chunk in (128, 64):
        llm = LLM(model_dir, **dict(KW, chunk_size=chunk, kv_cache_dtype=kv,
                                    speculative_config=spec))  # fmt: skip
        run = llm.engine._run
        steps[chunk] = []
        llm.engine._run = lambda work, s=steps[chunk], run=run: (
            s.append([w.n for w in work]) or run(work)
        )
        llm.generate(prompt, two)  # (the request lives on past its chunk: the MTP pass runs)
        cache = llm.engine.scheduler.cache
        (block,) = cache.with_snapshot.values()  # the one snapshot: at 64
        depth = 0
        while block is not None:
            depth, block = depth + 1, block.parent
        assert depth == 4
        (i,) = [b.snapshot for b in cache.with_snapshot.values()]
        st = llm.state
        snaps[chunk] = [
            sn[i * size : (i + 1) * size] for sn, (_, size) in zip(st.snapshots, st.all_rings)
        ]
    assert steps[128] == [[70], [1]] and steps[64] == [[64], [6], [1]]  # not cut / cut at 64
    for k, (a, b) in enumerate(zip(snaps[128], snaps[64])):
        assert a.abs().sum() > 0, k  # written
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=f"ring {k}")
    # the other prompts: the outputs without the cache
    llm = LLM(model_dir, **dict(KW, chunk_size=128, kv_cache_dtype=kv, speculative_config=spec))
    kw = dict(KW, kv_cache_dtype=kv, speculative_config=spec)
    want = _one_by_one(LLM(model_dir, enable_prefix_caching=False, **kw))
    _same(_one_by_one(llm), want)
    # prompt 3 hits 64; prompt 2 wrote a snapshot at 32 on prompt 1's blocks (they share 40
    # tokens), where prompt 5 (33 shared) then hits
    assert llm.engine.stats().prefix_cache_hits == 64 + 32


@pytest.mark.parametrize("k", [0, 2])
def test_generated_tokens_are_cached_too(model_dir: Path, k: int) -> None:
    # a follow-up prompt that repeats a prompt and its output (a multi-turn chat that keeps the
    # reply) hits the blocks decode steps filled, snapshotted where a step ended on a boundary
    # (with drafts: where the accepted tokens landed on one)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = _prompts()[3] + _prompts()[1]  # 70 tokens: its prompt's snapshots end at 64
    llm = LLM(model_dir, enable_prefix_caching=True, speculative_config=spec, **KW)
    out = llm.generate(first, long)[0]
    follow = first + out.token_ids + [7, 8, 9]
    want = LLM(model_dir, speculative_config=spec, enable_prefix_caching=False, **KW).generate(
        follow, GREEDY
    )[0]
    before = llm.engine.stats().prefix_cache_hits
    _same([llm.generate(follow, GREEDY)[0]], [want])
    hit = llm.engine.stats().prefix_cache_hits - before
    assert hit > 64  # past the prompt: blocks of generated tokens (80 or 96 of the 103)
    if not k:  # one token a step lands on every boundary
        assert hit == 96


def test_prompt_logprobs_bypass_the_cache(model_dir: Path) -> None:
    # their prompt tokens must run: no lookup, no insert
    llm = LLM(model_dir, enable_prefix_caching=True, **KW)
    p = _prompts()[0]
    lp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = llm.generate(p, lp)[0]
    b = llm.generate(p, lp)[0]
    assert a.prompt_logprobs == b.prompt_logprobs and len(a.prompt_logprobs) == len(p)
    assert llm.engine.stats().prefix_cache_queries == 0 and not llm.engine.scheduler.cache.blocks


def test_flush_drops_unheld_blocks(model_dir: Path, plain: list) -> None:
    llm = LLM(model_dir, enable_prefix_caching=True, **KW)
    llm.generate(_prompts()[0], GREEDY)
    cache = llm.engine.scheduler.cache
    n = len(cache.blocks)
    assert n == 4 and llm.engine.flush_cache() == n and not cache.blocks
    assert len(llm.engine.scheduler.free_pages) == llm.state.num_blocks
    _same(_one_by_one(llm), plain)


def test_warmup_leaves_the_cache_empty(model_dir: Path, plain: list) -> None:
    # the warm-up's prompts (one token repeated) find nothing of each other's: each prefill is
    # cut only as a served prompt's would be; then nothing is cached and nothing counted
    llm = LLM(model_dir, enable_prefix_caching=True, **KW)
    flushes = []
    real = llm.engine.flush_cache
    llm.engine.flush_cache = lambda: flushes.append(real())
    llm.warmup()
    cache = llm.engine.scheduler.cache
    assert not cache.blocks and cache.queries == cache.hits == 0 and sum(flushes) > 0
    _same(_one_by_one(llm), plain)


def test_on_by_default_off_by_flag_and_bad_snapshots(model_dir: Path) -> None:
    # on by default, as vLLM's --enable-prefix-caching; 4 snapshots a slot
    llm = LLM(model_dir, **KW)
    assert llm.engine.scheduler.cache is not None and llm.state.num_snapshots == 4 * KW["max_seqs"]
    llm = LLM(model_dir, enable_prefix_caching=False, **KW)
    assert llm.engine.scheduler.cache is None and llm.state.snapshots == []
    with pytest.raises(ValueError, match="prefix_snapshots must be >= 1"):
        LLM(model_dir, enable_prefix_caching=True, prefix_snapshots=0, **KW)


def test_default_snapshots_fit_a_quarter_of_the_pages_budget(model_dir: Path, caplog) -> None:  # noqa: ANN001
    # a memory budget: the default count is 4 a slot, cut to what a quarter of the bytes left
    # after the slots' fixed state holds; none fits: the cache is off, said in a warning
    args, dt = tiny_args(vocab_size=300), torch.float32
    fixed = bytes_per_seq(args, dt)
    slots = KW["max_seqs"] * fixed
    assert DecodeState.default_snapshots(args, 3, None, dt) == 12
    assert DecodeState.default_snapshots(args, 3, slots + 4 * 5 * fixed + 3, dt) == 5
    assert DecodeState.default_snapshots(args, 3, slots + 4 * 100 * fixed, dt) == 12
    assert DecodeState.default_snapshots(args, 3, slots + 4 * fixed - 1, dt) == 0
    page = bytes_per_token(args, dt) * KW["block_size"]
    llm = LLM(model_dir, max_memory=int(slots + 4 * 2 * fixed + 8 * page), **KW)
    assert llm.state.num_snapshots == 2 and llm.engine.scheduler.cache is not None
    with caplog.at_level("WARNING", logger="dsv4"):
        llm = LLM(model_dir, max_memory=int(slots + 3 * fixed), **KW)
    assert llm.state.num_snapshots == 0 and llm.engine.scheduler.cache is None
    assert "prefix caching off" in caplog.text


def test_two_ranks_with_cache_equal_one(model_dir: Path, plain: list) -> None:
    # every rank's scheduler caches and evicts alike (a flush included): same outputs
    two = LLM(model_dir, tensor_parallel_size=2, enable_prefix_caching=True, **KW)
    try:
        outs = _one_by_one(two)
        assert two.engine.flush_cache() > 0
        again = _one_by_one(two)
    finally:
        two.close()
    assert [o.token_ids for o in outs] == [w.token_ids for w in plain]
    assert [o.token_ids for o in again] == [w.token_ids for w in plain]


def test_server_metrics_and_flush(model_dir: Path) -> None:
    server, ac = in_process(model_dir, max_seqs=3, enable_prefix_caching=True)
    prompt = list(range(1, 300))  # past a block of the default size (256)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    async def go() -> tuple:
        async with ac:
            done = [await ac.post("/v1/completions", json=body) for _ in range(2)]
            native = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
            done.append(await ac.post("/generate", json=native))  # SGLang's meta_info
            return done, await ac.get("/metrics"), await ac.post("/flush_cache")

    try:
        done, metrics, flushed = asyncio.run(go())
    finally:
        server.shutdown()
    assert [r.status_code for r in done] == [200, 200, 200]
    assert done[2].json()["meta_info"]["cached_tokens"] == 256
    assert done[0].json()["choices"][0]["text"] == done[1].json()["choices"][0]["text"]
    # OpenAI's usage field for the tokens the cache found (none the first time)
    assert "prompt_tokens_details" not in done[0].json()["usage"]
    assert done[1].json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    rows = dict(ln.rsplit(" ", 1) for ln in metrics.text.splitlines() if ln.startswith("vllm:pre"))
    assert {k.split("{")[0]: float(v) for k, v in rows.items()} == {
        "vllm:prefix_cache_queries_total": 3 * len(prompt),
        "vllm:prefix_cache_hits_total": 2 * 256,
    }
    assert flushed.status_code == 200 and "1 cached blocks dropped" in flushed.json()["message"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [32, 128])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gpu_hits_give_the_outputs_without_cache(model_dir: Path, kv: str, chunk: int) -> None:
    # fp32 Triton kernels, CUDA graphs for decode steps, MTP drafts: the hits' outputs equal
    # the uncached ones (fp32 rounding only). Chunks of 128: the snapshot at 64 is written
    # inside the 70-token prompt's one chunk (compress_keep's snapshot rows on the GPU)
    kw = dict(KW, device="cuda", dtype="float32", ops="triton", quantized=True, cuda_graphs=True,
              kv_cache_dtype=kv, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
              chunk_size=chunk)  # fmt: skip
    want = _one_by_one(LLM(model_dir, enable_prefix_caching=False, **kw))
    llm = LLM(model_dir, enable_prefix_caching=True, **kw)
    outs = _one_by_one(llm)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        got = torch.tensor([e["logprob"] for e in o.logprobs])
        torch.testing.assert_close(got, torch.tensor([e["logprob"] for e in w.logprobs]),
                                   rtol=1e-3, atol=1e-3)  # fmt: skip
    assert llm.engine.stats().prefix_cache_hits == (32 + 64 + 32 if chunk == 32 else 64 + 32)
    assert llm.engine.graphs.graphs and not llm.engine.graphs.failed


# ---- the cache's bookkeeping ----------------------------------------------------------------


def _filled(n_snap: int = 2) -> PrefixCache:
    # blocks of 2 tokens: a chain [1,2] [3,4] [5,6] on pages 10, 11, 12, snapshot after the last
    c = PrefixCache(2, n_snap)
    last, fresh = c.insert([1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13], 3)
    assert fresh and last.page == 12
    c.snapshot_slot(last)
    return c


def test_match_needs_a_snapshot_and_leaves_a_token() -> None:
    c = _filled()
    assert [b.page for b in c.match([1, 2, 3, 4, 5, 6, 9])] == [10, 11, 12]
    assert c.match([1, 2, 3, 4, 5, 6]) == []  # all cached, but a token must run: only to 4,
    # and the block after [3, 4] has no snapshot
    assert c.match([1, 2, 3, 9, 5, 6, 7]) == []  # different second block
    assert c.match([2, 1, 3, 4, 5, 6, 7]) == []  # exact tokens, not a hash


def test_release_and_leaves_first_eviction() -> None:
    c = _filled()
    for page in (10, 11, 12):  # the inserting request lets go
        assert c.release(page)
    assert not c.release(13)  # its own page: not the cache's
    assert c.num_evictable == 3
    chain = c.match([1, 2, 3, 4, 5, 6, 0])
    c.acquire(chain)
    assert c.num_evictable == 0 and c.evict() is None
    for b in chain:
        c.release(b.page)
    assert [c.evict(), c.evict(), c.evict(), c.evict()] == [12, 11, 10, None]
    assert not c.blocks and c.free_snapshots == [1, 0]


def test_duplicate_blocks_stay_private_and_snapshots_recycle() -> None:
    c = _filled(n_snap=1)
    # another request prefilled the same first block into its own page: not cached
    assert c.insert([1, 2, 3, 4], [20, 21], 2) == (None, False)
    assert 20 not in c.by_page
    # a second snapshot with one slot takes the least recently used one's
    last, fresh = c.insert([1, 2, 8, 8, 0], [10, 22], 2)
    assert fresh
    assert c.snapshot_slot(last) == 0
    assert c.match([1, 2, 3, 4, 5, 6, 7]) == []  # the first chain lost its snapshot
    assert [b.page for b in c.match([1, 2, 8, 8, 0])] == [10, 22]


def test_insert_resumes_from_the_tail() -> None:
    # a running request's later boundaries continue the chain from its deepest block
    c = PrefixCache(2, 2)
    first, fresh = c.insert([1, 2, 3, 4, 9], [10, 11, 12], 2)
    assert fresh and first.page == 11
    last, fresh = c.insert([1, 2, 3, 4, 5, 6, 9], [10, 11, 12, 13], 3, (first, 2))
    assert fresh and last.parent is first and last.page == 12 and len(c.blocks) == 3
    c.snapshot_slot(last)
    assert [b.page for b in c.match([1, 2, 3, 4, 5, 6, 0])] == [10, 11, 12]
    # nothing new past the tail: the tail itself, already snapshotted
    assert c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12], 3, (last, 3)) == (last, False)


def test_forget_snapshot_keeps_the_blocks() -> None:
    # a snapshot its step could not complete is given back; the chain stays cached, unmatched
    c = _filled()
    (i,) = [b.snapshot for b in c.with_snapshot.values()]
    c.forget_snapshot(i)
    assert not c.with_snapshot and i in c.free_snapshots and len(c.blocks) == 3
    assert c.match([1, 2, 3, 4, 5, 6, 7]) == []
    c.forget_snapshot(i)  # (twice: nothing)
    assert c.free_snapshots.count(i) == 1


def test_a_request_that_ends_in_its_snapshot_step_leaves_none(model_dir: Path) -> None:
    # with speculative decoding the MTP layer's ring is written by the pass after the step, which
    # a finished request does not get: the snapshot inside its last chunk is given back
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(model_dir, **dict(KW, chunk_size=128, speculative_config=spec))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts()[0], one)
    cache = llm.engine.scheduler.cache
    assert not cache.with_snapshot and len(cache.blocks) == 4  # blocks to 64, no snapshot
    llm = LLM(model_dir, **dict(KW, chunk_size=128))  # (no MTP pass: the snapshot is whole)
    llm.generate(_prompts()[0], one)
    assert len(llm.engine.scheduler.cache.with_snapshot) == 1


def test_shared_blocks_past_a_hit_get_their_snapshot(model_dir: Path) -> None:
    # A (20 tokens) leaves a snapshot at 16; B = A[:16] + 44 hits it and leaves one at 48 (its
    # second block, 16..31, has none); C = B[:40] + 10 hits 16, runs into that block and writes
    # its snapshot at 32 inside its chunk (the rows of 16..31 from its own run); D = B[:33] + 9
    # then hits 32. Every output equals the uncached one
    g = torch.Generator().manual_seed(5)
    a = torch.randint(1, 300, (20,), generator=g).tolist()
    b = a[:16] + torch.randint(1, 300, (44,), generator=g).tolist()
    c = b[:40] + torch.randint(1, 300, (10,), generator=g).tolist()
    d = b[:33] + torch.randint(1, 300, (9,), generator=g).tolist()
    plain = LLM(model_dir, enable_prefix_caching=False, **KW)
    want = [plain.generate(p, GREEDY)[0] for p in (a, b, c, d)]
    llm = LLM(model_dir, **KW)
    hits = []
    for p in (a, b, c, d):
        before = llm.engine.stats().prefix_cache_hits
        _same([llm.generate(p, GREEDY)[0]], [want[len(hits)]])
        hits.append(llm.engine.stats().prefix_cache_hits - before)
    assert hits == [0, 16, 16, 32]


def test_a_failed_step_caches_nothing_it_did_not_write(model_dir: Path, plain: list) -> None:
    # a snapshot inside a chunk is reserved before the step and filed after the model ran: a
    # step that fails leaves no block cached and no snapshot taken; the prompt then runs as new
    llm = LLM(model_dir, **dict(KW, chunk_size=128))
    eng, cache = llm.engine, llm.engine.scheduler.cache
    free = sorted(cache.free_snapshots)
    run = eng._run

    def boom(work):  # noqa: ANN001, ANN202
        assert [len(w.snapshots) for w in work] == [1]  # the one at 64, reserved
        raise RuntimeError("boom")

    eng._run = boom
    rid = eng.add_request(_prompts()[0], GREEDY)
    with pytest.raises(RuntimeError, match="boom"):
        eng.step()
    assert not cache.blocks and sorted(cache.free_snapshots) == free
    eng.abort(rid)
    eng._run = run
    _same(_one_by_one(llm), plain)


def test_same_prompts_in_one_step_reserve_one_snapshot(model_dir: Path) -> None:
    # n = 3 completions are three requests with one prompt, prefilled in one step: one snapshot
    # is reserved at its last boundary (the others would find the blocks another's pages and
    # give theirs back, after evicting a snapshot for nothing); a repeat reserves none
    llm = LLM(model_dir, **dict(KW, chunk_size=128))
    cache, calls = llm.engine.scheduler.cache, []
    reserve = cache.reserve_snapshot
    cache.reserve_snapshot = lambda: calls.append(1) or reserve()
    sp = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=2, ignore_eos=True)
    llm.generate(_prompts()[0], sp)
    assert len(calls) == 1 and len(cache.with_snapshot) == 1
    llm.generate(_prompts()[0] + [1, 2], GREEDY)  # (hits 64: nothing past it to snapshot)
    assert len(calls) == 1
