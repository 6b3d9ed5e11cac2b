"""Python API, deterministic top-k, MTP forward, the demo model and `dsv4 generate`."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.engine import EngineError
from dsv4.ops import ref
from dsv4.state import Batch
from dsv4.tiny import make_tiny, tiny_args
from tests.test_config import EXACT, engine_flags


@pytest.fixture(scope="module")
def llm(tmp_path_factory):  # noqa: ANN001, ANN201
    return LLM(
        make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300)),
        device="cpu",
        progress=False,
    )


def test_score_shape_and_errors(llm):  # noqa: ANN001
    assert llm.score([0, 1, 2, 3]).shape == (4, 300)
    with pytest.raises(ValueError, match="out of range"):
        llm.score([0, 300])
    with pytest.raises(ValueError, match="empty"):
        llm.score([])


def test_generate_text_and_ids(llm):  # noqa: ANN001
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = llm.generate(["hello", [0, 5, 6, 7]], sp)
    assert len(a.token_ids) == len(b.token_ids) == 4 and a.finish_reason == "length"
    assert a.prompt_token_ids[0] == llm.args.bos_token_id and isinstance(a.text, str)
    # batched generation equals one-at-a-time generation
    assert llm.generate("hello", sp)[0].token_ids == a.token_ids


def test_stable_topk_ties_pick_lower_index():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert ref.stable_topk(s, 2).tolist() == [[1, 2]]
    # indexer: equal (zero) scores everywhere -> the lowest entry ids; invisible entries -> -1
    q, w = torch.zeros(1, 2, 4), torch.ones(1, 2)
    keys = torch.randn(6, 4)
    cand = torch.tensor([[0, 1, 2, 3, -1, -1]])
    assert ref.index_topk(q, w, keys, cand, 3).tolist() == [[0, 1, 2]]
    assert ref.index_topk(q, w, keys, cand, 6).tolist() == [[0, 1, 2, 3, -1, -1]]


def test_mtp_forward_chunked_equals_full(llm):  # noqa: ANN001
    # the MTP block keeps its own window ring: chunked MTP passes equal one full pass
    m = llm.model
    ids = list(range(2, 30))
    nxt = ids[1:] + [5]

    def run(chunk: int) -> torch.Tensor:
        out = []
        for s in range(0, len(ids), chunk):
            b = Batch.build([0], [s], [len(ids[s : s + chunk])], llm.score_state())
            h = m(torch.tensor(ids[s : s + chunk]), b, llm.score_state())
            x = m.mtp_forward(h, torch.tensor(nxt[s : s + chunk]), b, llm.score_state())
            out.append(m.mtp_logits(x))
        return torch.cat(out)

    full = run(len(ids))
    assert full.shape == (len(ids), 300) and full.isfinite().all()
    assert torch.allclose(run(3), full, rtol=1e-5, atol=1e-5)
    b = Batch.build([0], [0], [len(ids)], llm.score_state())
    h = m(torch.tensor(ids), b, llm.score_state())
    other = m.mtp_logits(m.mtp_forward(h, torch.tensor(nxt[::-1]), b, llm.score_state()))
    assert not torch.allclose(other[1:], full[1:])  # depends on the next-token embedding,
    torch.testing.assert_close(other[0], full[0])  # except at position 0, masked (as vLLM)


def test_demo_generate_cli(tmp_path, monkeypatch, capsys):  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "The capital of France is", "--max-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "finish_reason=length" in captured.err and captured.out.strip()


def test_generate_cli_bad_model(tmp_path, capsys):  # noqa: ANN001
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_generate_cli_ops_flag(llm, capsys):  # noqa: ANN001
    # --ops triton reaches the model: same greedy ids as the reference ops (interpreter on CPU)
    d = str(llm.model_dir)
    outs = []
    for ops in ("ref", "triton"):
        assert main(["generate", "hi", "--model", d, "--ops", ops, "--max-tokens", "2"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
    with pytest.raises(SystemExit):  # argparse refuses an unknown backend
        main(["generate", "hi", "--model", d, "--ops", "cuda"])


def test_engine_flags_default_auto(llm, monkeypatch, capsys):  # noqa: ANN001
    # unset engine flags reach LLM as "auto" / None (resolved there: tests/test_config.py);
    # --no-quantized, --enforce-eager and --no-cuda-graphs are explicit offs
    from dsv4 import cli

    build_llm, built = cli.build_llm, []
    keys = ("device", "dtype", "ops", "quantized", "cuda_graphs")
    monkeypatch.setattr(
        cli, "build_llm", lambda ns: built.append([getattr(ns, k) for k in keys]) or llm
    )
    d = str(llm.model_dir)
    base = ["generate", "hi", "--model", d, "--max-tokens", "1"]
    for extra in ([], ["--no-quantized", "--enforce-eager"], ["--quantized", "--no-cuda-graphs"]):
        assert main(base + extra) == 0
    assert built == [
        ["auto", "auto", "auto", None, None],
        ["auto", "auto", "auto", False, False],
        ["auto", "auto", "auto", True, False],
    ]
    monkeypatch.setattr(cli, "build_llm", build_llm)
    assert main(base[:-2] + ["--device", "cuda"]) == 2  # no CUDA in the CPU tests
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_default_llm_is_the_exact_cpu_path(llm):  # noqa: ANN001
    assert engine_flags(llm.config) == EXACT
    assert llm.engine.graphs is None


@pytest.mark.parametrize("chunk", [None, 512])
def test_warmup_meets_every_shape_and_leaves_the_engine_empty(llm, chunk, monkeypatch):  # noqa: ANN001
    # one prefill step of each power-of-two length up to the step budget (and one token more):
    # up to the chunk size one prompt, past it several admitted together; then decode steps at
    # every batch bucket up to max_seqs; nothing held afterwards. The default chunk is the step
    # budget (as vLLM's); a smaller one takes the several-prompt steps
    if chunk is not None:
        llm = LLM(llm.model_dir, device="cpu", progress=False, chunk_size=chunk)
    steps, starts = [], []
    run = llm.engine._run
    monkeypatch.setattr(
        llm.engine,
        "_run",
        lambda work: (
            (steps.append([w.n for w in work]), starts.append([w.start for w in work]))
            and run(work)
        ),
    )
    assert llm.warmup() > 0
    s = llm.engine.scheduler
    # each length up to a chunk again as a second chunk, after a first of a whole chunk (the
    # shapes of a prefix-cache hit), where the prompt fits max_seq_len (4096)
    per = chunk or 2048
    seconds = {p[0] for p, st in zip(steps, starts) if len(p) == 1 and st == [per]}
    want = {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025}
    assert seconds == {n for n in want if n <= per and per + n <= 4094}, seconds
    assert (s.chunk_size, s.max_step_tokens) == (chunk or 2048, 2048)
    prefills = {p[0] for p in steps if len(p) == 1 and p[0] > 1} | {1}
    lengths = {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512}
    if chunk is None:  # one prompt a step up to the budget
        lengths |= {513, 1024, 1025, 2048}
    # (prefix caching, on by default, snapshots inside a chunk: a prompt is not cut)
    assert s.cache is not None
    assert prefills == lengths
    # steps of several prompts past 512 tokens: with chunks of 512, 513, 1024 (2 x 512), 1025 (+ 1),
    # 2048 (4 x 512); with chunks of the budget, one step of 4 x 512
    together = sorted(sum(p) for p in steps if len(p) > 1 and sum(p) > 512)
    assert together == ([513, 1024, 1025, 2048] if chunk else [2048]), together  # (4 x 512)
    assert max(sum(p) for p in steps) == s.max_step_tokens
    decodes = {len(p) for p in steps if set(p) == {1}}
    assert decodes >= {1, 2, 4, 8}  # max_seqs 8 (and the multi-prompt steps' last tokens)
    st = llm.engine.stats()
    assert not llm.engine.has_work() and st.num_free_pages == st.num_pages and not st.num_running


def test_kv_cache_dtype_flag_and_config(llm, monkeypatch):  # noqa: ANN001
    # --kv-cache-dtype fp8 reaches the state; a bad value is refused by argparse and the config
    from dsv4 import cli
    from dsv4.config import ConfigError, EngineConfig

    built = []
    monkeypatch.setattr(cli, "build_llm", lambda ns: built.append(ns.kv_cache_dtype) or llm)
    d = str(llm.model_dir)
    assert (
        main(["generate", "hi", "--model", d, "--kv-cache-dtype", "fp8", "--max-tokens", "1"]) == 0
    )
    assert built == ["fp8"]
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--model", d, "--kv-cache-dtype", "fp4"])
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


def test_chat_is_generate_on_the_chat_format(llm):  # noqa: ANN001
    # vLLM's LLM.chat: conversations rendered by encode_messages, then generated
    from dsv4.chat import encode_messages

    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    talk = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    other = [{"role": "user", "content": "why"}]
    a, b = llm.chat([talk, other], sp, chat_template_kwargs={"thinking": True})
    ids = llm.tokenizer.encode(encode_messages(talk, thinking=True), add_special_tokens=False).ids
    assert a.prompt_token_ids == ids and a.token_ids == llm.generate([ids], sp)[0].token_ids
    assert llm.chat(other, sp)[0].prompt_token_ids != b.prompt_token_ids  # thinking changes it
    with pytest.raises(ValueError, match="unknown keys"):
        llm.chat(talk, sp, chat_template_kwargs={"thinkng": True})
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}], sp)
    # vLLM's continue_final_message: the final assistant message left open
    going = other + [{"role": "assistant", "content": "Because"}]
    (c,) = llm.chat(going, sp, add_generation_prompt=False, continue_final_message=True)
    text = encode_messages(going, add_generation_prompt=False, continue_final_message=True)
    assert c.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False).ids
    assert text.endswith("Because")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(going, sp, continue_final_message=True)


def test_step_and_page_flags_reach_the_engine(llm):  # noqa: ANN001
    # --max-num-batched-tokens / --page-size (and our names) through the CLI's engine flags
    from dsv4.cli import build_llm
    from dsv4.server import parse_args

    c = parse_args(["--model", str(llm.model_dir), "--page-size", "16", "--max-step-tokens", "64"])
    built = build_llm(c)
    assert built.state.block_size == 16 and built.engine.scheduler.max_step_tokens == 64
    assert built.engine.scheduler.chunk_size == 64  # by default a chunk is the step budget
    c = parse_args(["--model", str(llm.model_dir), "--chunk-size", "16"])
    assert build_llm(c).engine.scheduler.chunk_size == 16
    with pytest.raises(ValueError, match="block_size=12 must be a multiple of ratio"):
        LLM(llm.model_dir, device="cpu", progress=False, block_size=12)
    with pytest.raises(ValueError, match="max_step_tokens must be >= 1"):
        LLM(llm.model_dir, device="cpu", progress=False, max_step_tokens=0)


def test_state_budget_flags(llm):  # noqa: ANN001
    # one budget: max_memory, memory_fraction (of what is free after the weights) or vLLM's
    # gpu_memory_utilization / SGLang's --mem-fraction-static (of the device's total, less what it
    # holds after the weights); the fractions need a CUDA device
    from dsv4.config import ConfigError
    from dsv4.llm import utilization_budget

    gib = 2**30
    assert (
        utilization_budget(0.9, free=60 * gib, total=140 * gib) == int(0.9 * 140 * gib) - 80 * gib
    )
    with pytest.raises(ValueError, match=r"0.5 of 140.0 GiB leaves no room .* 80.0 GiB are in use"):
        utilization_budget(0.5, free=60 * gib, total=140 * gib)
    # the activations' profiled peak stays out of it
    assert utilization_budget(0.9, free=60 * gib, total=140 * gib, reserve=2 * gib) == (
        int(0.9 * 140 * gib) - 82 * gib
    )
    with pytest.raises(ValueError, match="a step's activations take 50.0 GiB"):
        utilization_budget(0.9, free=60 * gib, total=140 * gib, reserve=50 * gib)
    d = llm.model_dir
    with pytest.raises(ValueError, match="gpu_memory_utilization needs a CUDA device"):
        LLM(d, device="cpu", progress=False, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="memory_fraction needs a CUDA device"):
        LLM(d, device="cpu", progress=False, memory_fraction=0.5)
    with pytest.raises(ConfigError, match="give one state budget, not max_memory and memory_frac"):
        LLM(d, device="cpu", progress=False, max_memory=1 << 30, memory_fraction=0.5)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\], got 0"):
        LLM(d, device="cpu", progress=False, gpu_memory_utilization=0.0)


def test_n_completions_as_vllm(llm):  # noqa: ANN001
    # SamplingParams.n: one RequestOutput per prompt, its `outputs` the n completions (index j,
    # seed + j: each as its own seeded request); n = 1 keeps `outputs` = [itself]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    a, b = llm.generate(["hello", [0, 5, 6]], sp)
    assert [o.index for o in a.outputs] == [0, 1, 2] and len(b.outputs) == 3
    for j, o in enumerate(a.outputs):
        alone = llm.generate("hello", SamplingParams(temperature=1.0, seed=7 + j, max_tokens=5,
                                                     ignore_eos=True))[0]  # fmt: skip
        assert o.token_ids == alone.token_ids and o.text == alone.text
    assert a.token_ids == a.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # different draws
    one = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2))[0]
    assert one.outputs == [one] and one.outputs[0].text == one.text
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one request is one completion"):
        llm.engine.add_request([0, 5], SamplingParams(n=2))


def test_capacity_lines_as_vllm(llm, caplog):  # noqa: ANN001
    # "KV cache size: N tokens" and "Maximum concurrency for L tokens per request: X.XXx": the
    # pages a budget leaves (4 of 16 tokens here) over the pages one max_seq_len request needs
    from dsv4.state import bytes_per_seq, bytes_per_token

    args = llm.args
    fixed = 4 * bytes_per_seq(args, torch.float32)
    page = bytes_per_token(args, torch.float32) * 16
    with caplog.at_level("INFO", logger="dsv4"):
        LLM(llm.model_dir, device="cpu", progress=False, max_seqs=4, max_seq_len=32,
            block_size=16, max_memory=int(fixed + 4.5 * page), enable_prefix_caching=False)  # fmt: skip
    text = caplog.text
    assert "KV cache size: 64 tokens" in text
    assert "Maximum concurrency for 32 tokens per request: 2.00x" in text  # 4 pages / 2 (4 slots)


def test_max_total_tokens_caps_the_pages(llm):  # noqa: ANN001
    # SGLang's --max-total-tokens: the pages' tokens at most that (whole pages), under the
    # budget's own count or the default (every slot at max_seq_len); one page at least
    from dsv4.config import ConfigError
    from dsv4.state import bytes_per_seq, bytes_per_token

    kw = dict(device="cpu", progress=False, max_seqs=4, max_seq_len=64, block_size=16,
              enable_prefix_caching=False)  # fmt: skip
    d = llm.model_dir
    assert LLM(d, **kw).state.num_blocks == 16  # 4 slots x 4 pages
    assert LLM(d, max_total_tokens=40, **kw).state.num_blocks == 3  # 40 tokens: 3 pages
    fixed = 4 * bytes_per_seq(llm.args, torch.float32)
    page = bytes_per_token(llm.args, torch.float32) * 16
    budget = int(fixed + 2.5 * page)  # 2 pages: under the cap
    assert LLM(d, max_memory=budget, max_total_tokens=40, **kw).state.num_blocks == 2
    with pytest.raises(ConfigError, match="max_total_tokens must be > 0, got 0"):
        LLM(d, max_total_tokens=0, **kw)


def test_max_seq_len_auto(llm, caplog):  # noqa: ANN001
    # vLLM's --max-model-len auto: the longest sequence the state's pages hold (at most the
    # model's own limit), resolved once the budget is known; it needs a budget
    from dsv4.config import AUTO_SEQ_LEN, ConfigError
    from dsv4.state import bytes_per_seq, bytes_per_token

    kw = dict(device="cpu", progress=False, max_seqs=2, block_size=16, enable_prefix_caching=False)
    d = llm.model_dir
    with caplog.at_level(logging.INFO, logger="dsv4"):
        capped = LLM(d, max_seq_len=AUTO_SEQ_LEN, max_total_tokens=40, **kw)
    assert capped.config.max_seq_len == 48 == capped.state.max_seq_len  # 3 pages of 16
    assert "max_seq_len auto: 48 tokens" in caplog.text
    page = bytes_per_token(llm.args, torch.float32) * 16
    budget = int(2 * bytes_per_seq(llm.args, torch.float32) + 5.5 * page)
    by_budget = LLM(d, max_seq_len=AUTO_SEQ_LEN, max_memory=budget, **kw)
    assert by_budget.config.max_seq_len == 16 * by_budget.state.num_blocks == 80
    out = by_budget.generate([list(range(3, 70))], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5  # a 67-token prompt fits in 80 now
    with pytest.raises(ConfigError, match="give gpu_memory_utilization, memory_fraction"):
        LLM(d, max_seq_len=AUTO_SEQ_LEN, **kw)


def _a_and_b(tmp_path):  # noqa: ANN001, ANN202
    # two checkpoints of one tiny model, an LLM on the first, and each one's greedy tokens:
    # (llm, gen, a, b, first, fresh_b)
    args = tiny_args(vocab_size=300)
    a, b = make_tiny(tmp_path / "a", args, seed=0), make_tiny(tmp_path / "b", args, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["hello", [0, 5, 6, 7]]
    llm = LLM(a, device="cpu", progress=False)

    def gen() -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, sp)]

    first = gen()
    fresh_b = [o.token_ids for o in LLM(b, device="cpu", progress=False).generate(prompts, sp)]
    assert fresh_b != first
    return llm, gen, a, b, first, fresh_b


def test_reload_weights_in_place(tmp_path, monkeypatch):  # noqa: ANN001
    # another checkpoint of the same model loaded into the running one (RL weight sync): the same
    # outputs as a fresh load of it, the first ones back after loading the first again, the
    # parameters' storage unchanged (captured graphs keep reading them); another model's config
    # and a load that fails half way are refused with the loaded weights still answering
    llm, gen, a, b, first, fresh_b = _a_and_b(tmp_path)
    ptrs = {k: v.data_ptr() for k, v in llm.model.state_dict().items()}
    llm.reload_weights(b)
    assert gen() == fresh_b
    assert {k: v.data_ptr() for k, v in llm.model.state_dict().items()} == ptrs
    assert llm.model_dir == b
    llm.reload_weights(a)
    assert gen() == first
    other = make_tiny(tmp_path / "c", tiny_args(vocab_size=300, n_routed_experts=4), seed=0)
    with pytest.raises(ValueError, match="n_routed_experts"):
        llm.reload_weights(other)
    with pytest.raises(ValueError, match="no config.json"):
        llm.reload_weights(tmp_path / "nothing")
    import dsv4.llm as llm_mod

    real = llm_mod.load_checkpoint

    def half_way(model, path, progress=True):  # noqa: ANN001, ANN202
        if path == b:  # writes some of b, then fails
            model.embed.weight.data.zero_()
            raise ValueError("a NaN code in tensor layers.3.ffn")
        return real(model, path, progress)

    monkeypatch.setattr(llm_mod, "load_checkpoint", half_way)
    with pytest.raises(ValueError, match="are back"):
        llm.reload_weights(b)
    assert llm.model_dir == a
    assert gen() == first


def test_sleep_and_wake_up(tmp_path):  # noqa: ANN001
    # vLLM's sleep mode: level 1 gives back every weight and state storage and brings the weights
    # back as they were (the same greedy tokens after wake_up, over a zeroed state and no stale
    # cached prefix); requests, scores and steps are refused while asleep, and sleep with a
    # running request (a waiting one has no state to lose); level 2 drops the weights: refused until reload_weights; wake_up by tags
    args = tiny_args(vocab_size=300)
    a = make_tiny(tmp_path / "a", args, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3 + i % 290 for i in range(300)], [0, 5, 6, 7]]  # (the first: a cached block)
    llm = LLM(a, device="cpu", progress=False, block_size=16)
    cache = llm.engine.scheduler.cache  # (cached prefixes must not outlive the state)

    def gen() -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, sp)]

    first = gen()
    assert gen() == first and cache.hits  # (the second time from the cached prefix)
    weights = {k: v.clone() for k, v in llm.model.state_dict().items()}
    llm.add_request(prompts[1], sp, "busy")
    llm.engine.step()  # (running: its state is in the pools)
    with pytest.raises(ValueError, match="1 requests are running"):
        llm.sleep()
    llm.engine.abort("busy")
    llm.add_request(prompts[1], sp, "waiting")  # (no state yet: it may wait through a sleep)
    llm.sleep(tags=["kv_cache"])
    with pytest.raises(EngineError, match="asleep"):
        llm.engine.step()
    llm.wake_up()
    llm.engine.abort("waiting")
    llm.sleep(level=1)
    assert llm.is_sleeping
    assert all(p.untyped_storage().nbytes() == 0 for p in llm.model.parameters())
    assert all(t.untyped_storage().nbytes() == 0 for t in llm.state.tensors())
    with pytest.raises(ValueError, match="asleep"):
        gen()
    with pytest.raises(ValueError, match="asleep"):
        llm.score(prompts[1])
    with pytest.raises(ValueError, match="asleep"):
        llm.reload_weights(a)
    llm.wake_up()
    assert not llm.is_sleeping
    assert all(torch.equal(v, weights[k]) for k, v in llm.model.state_dict().items())
    host = llm._host_copy.data_ptr()  # (kept for the next sleep, which reuses it)
    assert all(not t.any() for t in llm.state.tensors())
    assert gen() == first
    llm.sleep()
    assert llm._released["weights"].host.data_ptr() == host
    llm.wake_up()
    assert gen() == first
    # level 2, woken in two steps with the weight update in between (as RL loops do)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping
    llm.reload_weights(a)
    with pytest.raises(ValueError, match=r"asleep \(kv_cache released\)"):
        gen()
    llm.wake_up(tags=["kv_cache"])
    assert gen() == first
    llm.sleep(level=2, tags=["weights"])
    llm.wake_up()
    assert not any(p.any() for p in llm.model.parameters())  # dropped: zeros, not old bytes
    with pytest.raises(ValueError, match="reload them first"):
        gen()
    llm.reload_weights(a)
    assert gen() == first
    with pytest.raises(ValueError, match="unknown memory tags"):
        llm.sleep(tags=["kv"])
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)


def test_update_weights_from_tensor(tmp_path):  # noqa: ANN001
    # SGLang's update_weights_from_tensor: another checkpoint's tensors from memory give a fresh
    # load's outputs; a subset writes just those parameters; a quantized weight given as one
    # float tensor is quantized as the checkpoint stores it; a bad batch (unknown name, wrong
    # shape, a missing or orphan scale, NaN codes, a name twice) is refused with nothing written
    from safetensors.torch import load_file

    from dsv4 import quant
    from dsv4.checkpoint import checkpoint_tensors, companion_names

    llm, gen, a, b, first, fresh_b = _a_and_b(tmp_path)
    args = llm.args
    tb = load_file(next(b.glob("*.safetensors")))
    ta = load_file(next(a.glob("*.safetensors")))
    n = llm.update_weights_from_tensor(list(tb.items()))
    assert n == len(set(tb) - companion_names(checkpoint_tensors(args)))
    assert gen() == fresh_b
    llm.update_weights_from_tensor(ta.items())
    assert gen() == first
    params = llm.model.state_dict()
    # a subset: the embedding alone
    llm.update_weights_from_tensor([("embed.weight", tb["embed.weight"])])
    after = llm.model.state_dict()
    assert torch.equal(after["embed.weight"], tb["embed.weight"].float())
    assert all(torch.equal(after[k], v) for k, v in params.items() if k != "embed.weight")
    llm.update_weights_from_tensor([("embed.weight", ta["embed.weight"])])
    # one float [out, in] tensor for an FP8 weight and for an MXFP4 expert: quantized here
    w8, w4 = torch.randn(32, 64), torch.randn(32, 64)
    llm.update_weights_from_tensor([
        ("layers.0.attn.wq_a.weight", w8), ("layers.1.ffn.experts.3.w1.weight", w4)
    ])  # fmt: skip
    got = llm.model.state_dict()
    assert torch.equal(got["layers.0.attn.wq_a.weight"], quant.dequant_fp8(*quant.quant_fp8(w8)))
    assert torch.equal(
        got["layers.1.ffn.experts.3.w1.weight"], quant.dequant_mxfp4(*quant.quant_mxfp4(w4))
    )
    llm.update_weights_from_tensor(ta.items())
    before = {k: v.clone() for k, v in llm.model.state_dict().items()}
    nan = tb["layers.0.attn.wq_a.scale"].clone()
    nan.view(torch.uint8).fill_(0xFF)
    ok = ("embed.weight", tb["embed.weight"])  # (first in every bad batch: not written either)
    bad = {
        "not in the checkpoint's table": [ok, ("layers.0.attn.wq.weight", w8)],
        r"expected BF16 \[300, 64\], given": [ok, ("head.weight", tb["head.weight"][:, :8])],
        "given without": [ok, ("layers.0.attn.wq_a.weight", tb["layers.0.attn.wq_a.weight"])],
        "scales given without their weight": [ok, ("layers.0.attn.wq_a.scale", nan)],
        "e8m0 NaN scales": [
            ok, ("layers.0.attn.wq_a.weight", tb["layers.0.attn.wq_a.weight"]),
            ("layers.0.attn.wq_a.scale", nan),
        ],
        "given twice": [ok, ok],
    }  # fmt: skip
    for why, batch in bad.items():
        with pytest.raises(ValueError, match=why):
            llm.update_weights_from_tensor(batch)
    assert all(torch.equal(v, before[k]) for k, v in llm.model.state_dict().items())
    assert gen() == first


def test_update_weights_from_transformers_names(tmp_path):  # noqa: ANN001
    # a trainer holding transformers' DeepseekV4 (its names, the routed experts stacked, fp32):
    # its state_dict written into a model running another checkpoint gives that checkpoint's
    # tokens (the FP8 / FP4 weights quantized again as the checkpoint stores them); every name
    # of the table (but MTP's, which transformers does not hold) comes back from the reference's
    # renames (tests/reference.py, written apart from dsv4.hf_names)
    import re

    from dsv4 import hf_names
    from dsv4.checkpoint import checkpoint_tensors, companion_names
    from tests.reference import _RENAMES, hf_model

    llm, gen, a, b, first, fresh_b = _a_and_b(tmp_path)
    llm.update_weights_from_tensor(hf_model(b).state_dict().items())
    assert gen() == fresh_b
    table = checkpoint_tensors(llm.args)
    for name in set(table) - companion_names(table):
        if name.startswith("mtp.") or ".experts." in name and "shared" not in name:
            continue
        hf = name
        for pat, rep in _RENAMES:
            hf = re.sub(pat, rep, hf)
        assert hf_names.is_hf(hf) and hf_names.native_name(hf) == name, (name, hf)
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        llm.update_weights_from_tensor([("model.layers.1.ffn.experts.gate_up_proj", torch.ones(3))])
