"""tool_choice "required" / a named function with constrained arguments: the DSML tool-call
block the model writes, as a `dsv4.automaton.Automaton`.

  compile_tool_calls(tools, name, parallel) -> Automaton

The automaton starts where the forced start of the block ends (`chat.tool_call_prefix`: after
`<｜DSML｜invoke name="` for "required", after the named invoke's tag and newline for a name)
and ends with `</｜DSML｜tool_calls>`, then EOS. Each invoke takes its function's parameters in
the schema's order, as `render_tool_calls` writes them: required ones always, optional ones
when the model writes them, no others. A string parameter (`string="true"`) is raw text: free
text without `</｜DSML｜parameter>`, or its enum / const, pattern (a search), format or length
bounds; any other is JSON under its schema (`string="false"`). A parameter schema this
compiler cannot take is an error for a `strict` function and left free otherwise. "required"
may call several functions (unless parallel_tool_calls is false); a named function is called
once.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from dsv4.automaton import Automaton, SchemaError, _bits
from dsv4.chat import CALLS_END, DSML
from dsv4.json_schema import ANNOTATIONS, _Compiler
from dsv4.regex import regex_piece

PARAM_END = f"</{DSML}parameter>".encode()
INVOKE_END = f"\n</{DSML}invoke>".encode()
RAW_LT = _bits(range(256)) & ~_bits(b"<")  # a raw character under length bounds: no '<'


def _avoid(a: Automaton, word: bytes) -> tuple[int, int]:
    """Any bytes in which `word` does not occur (a KMP automaton: node i = the longest prefix of
    word the text ends with), exit from every node."""
    m = len(word)
    fail = [0] * m  # KMP failure function
    k = 0
    for i in range(1, m):
        while k and word[i] != word[k]:
            k = fail[k - 1]
        if word[i] == word[k]:
            k += 1
        fail[i] = k
    nodes = [a.node() for _ in range(m)]
    out = a.node()
    for i in range(m):
        targets: dict[int, int] = {}
        for b in range(256):
            j = i
            while j and word[j] != b:
                j = fail[j - 1]
            j = j + 1 if word[j] == b else 0
            if j < m:  # (j == m: the word occurs: no edge)
                targets[j] = targets.get(j, 0) | 1 << b
        for j, mask in targets.items():
            a.edges[nodes[i]].append((mask, nodes[j]))
        a.eps[nodes[i]].append(out)
    return nodes[0], out


class _ToolCompiler(_Compiler):
    strict = False  # the function being compiled is strict (set per invoke)

    def raw_string(self, s: dict, path: str) -> tuple[int, int]:
        # the value of a string="true" parameter
        a = self.a
        if "pattern" in s:
            return regex_piece(a, s["pattern"], json_string=False, search=True)
        if "format" in s:
            return self.formatted(s, path, quoted=False)
        if "minLength" in s or "maxLength" in s:  # characters without '<' (no closing tag)
            lo, hi = self._bounds(s, "minLength", "maxLength", path)

            def char() -> tuple[int, int]:
                return a.alt(a.byte_set(RAW_LT & _bits(range(0x80))), *self.utf8_multibyte())

            return a.repeat(char, lo, hi)
        return _avoid(a, PARAM_END)

    def parameter(self, key: str, s: Any, path: str) -> tuple[int, int]:
        """One parameter's tag and value; a schema this compiler cannot constrain to is a
        SchemaError for a `strict` function, else the value is left free (OpenAI promises schema
        adherence only for strict functions)."""
        try:
            return self.typed_parameter(key, s, path)
        except SchemaError:
            if self.strict:
                raise
            return self.typed_parameter(key, True, path)

    def typed_parameter(self, key: str, s: Any, path: str) -> tuple[int, int]:
        a = self.a
        head = f'<{DSML}parameter name="{key}" string="'.encode()
        raw, as_json = [], []
        if isinstance(s, dict) and ("enum" in s or "const" in s):
            values = [s["const"]] if "const" in s else s["enum"]
            raw = [a.lit(v.encode()) for v in values if isinstance(v, str)]
            rest = [v for v in values if not isinstance(v, str)]
            as_json = [self.value({"enum": rest}, path)] if rest else []
        elif s is True or s == {} or (isinstance(s, dict) and not set(s) - ANNOTATIONS):
            raw, as_json = [_avoid(a, PARAM_END)], [self.any_value()]
        elif isinstance(s, dict) and "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            if "string" in types:
                raw = [self.raw_string(s, path)]
            others = [t for t in types if t != "string"]
            if others:
                as_json = [self.value({**s, "type": others}, path)]
        else:  # anyOf, $ref, ...: JSON under the schema
            as_json = [self.value(s, path)]
        options = [a.seq(a.lit(head + b'true">'), r, a.lit(PARAM_END)) for r in raw]
        options += [a.seq(a.lit(head + b'false">'), j, a.lit(PARAM_END)) for j in as_json]
        if not options:
            raise SchemaError(f"{path}: no value fits")
        return a.alt(*options)

    def parameters(self, fn: dict, path: str) -> tuple[int, int]:
        # the parameters one per line in the schema's order, then the invoke's end (an invoke with
        # none has an empty line, as `render_tool_calls` writes it)
        a = self.a
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = params.get("required") or []
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{path}: required parameter {missing[0]!r} is not in properties")
        out = a.node()
        end = self.then(a.lit(INVOKE_END), out)

        def first(key: str) -> tuple[int, int]:
            return self.parameter(key, props[key], f"{path}/parameters/properties/{key}")

        later = lambda key: a.seq(a.lit(b"\n"), first(key))  # noqa: E731
        return self.in_order(list(props), required, first, later, end, end), out

    def invoke(self, name: str, fn: dict, with_tag: bool) -> tuple[int, int]:
        a = self.a
        self.root = fn.get("parameters") or {}  # ($refs resolve in the function's parameters)
        self.strict = fn.get("strict") is True
        body = self.parameters(fn, f"#/tools/{name}")
        if not with_tag:
            return body
        return a.seq(a.lit(f'<{DSML}invoke name="{name}">\n'.encode()), body)


@lru_cache(maxsize=64)
def _compiled(key: str) -> Automaton:
    tools, name, parallel = json.loads(key)
    fns = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            fns[fn["name"]] = fn
    if name is not None and name not in fns:
        raise SchemaError(f"tool_choice names {name!r}, which is not in tools")
    c = _ToolCompiler({})
    a = c.a
    close = a.lit(f"\n{CALLS_END}".encode())
    if name is not None:  # after the named invoke's tag: its parameters, once
        a.finish(a.seq(c.invoke(name, fns[name], with_tag=False), close), ws=False)
        return a

    def call(tail_of_tag: bool) -> tuple[int, int]:
        # one invoke of any function (the first: after `<｜DSML｜invoke name="`)
        return a.alt(*(
            a.seq(a.lit(f'{n}">\n'.encode()), c.invoke(n, fn, with_tag=False)) if tail_of_tag
            else a.seq(a.lit(b"\n"), c.invoke(n, fn, with_tag=True))
            for n, fn in fns.items()
        ))  # fmt: skip

    more = a.star(call(False)) if parallel else a.empty()
    a.finish(a.seq(call(True), more, close), ws=False)
    return a


def compile_tool_calls(tools: list[dict], name: str | None, parallel: bool = True) -> Automaton:
    """The constrained rest of a forced DSML tool-call block (module docstring)."""
    if not isinstance(tools, list) or not tools:
        raise SchemaError("tools must be a non-empty list")
    return _compiled(json.dumps([tools, name, bool(parallel)]))
