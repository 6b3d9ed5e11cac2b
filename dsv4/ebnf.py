"""Grammars (GBNF / xgrammar's EBNF) compiled into a `dsv4.automaton.Automaton`: vLLM's
guided_grammar and structured_outputs grammar, SGLang's ebnf.

  compile_grammar(text) -> Automaton      the output is one sentence of the rule `root`

Syntax: rules `name ::= expression`, a rule running until the next `name ::=`; expressions of
alternatives `|`, sequences, groups `( )`, string literals "..." (escapes \\n \\t \\r \\\\ \\"
\\xHH \\uHHHH \\UHHHHHHHH), character classes [...] and [^...] (`dsv4.regex`'s), `.` (any
character), rule references, the quantifiers * + ? {m} {m,} {m,n}; `#` starts a comment. Each
rule is a subroutine of the automaton, so rules may recurse, up to `json_schema.MAX_DEPTH`
nested rule calls; left recursion is refused (as llama.cpp's GBNF does): it would nest calls to
that bound before every character. The output is plain text (UTF-8), not JSON.
"""

from __future__ import annotations

from functools import lru_cache

from dsv4.automaton import Automaton, SchemaError
from dsv4.regex import _negate, _Parser, _piece

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _Grammar(_Parser):
    """The rules of a grammar text as regex trees, with ("ref", name) nodes."""

    def fail(self, what: str) -> SchemaError:
        line = self.p.count("\n", 0, self.i) + 1
        return SchemaError(f"grammar: {what} (line {line})")

    def skip(self) -> None:
        # whitespace and comments between tokens
        while self.i < len(self.p):
            c = self.p[self.i]
            if c == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end < 0 else end
            elif c.isspace():
                self.i += 1
            else:
                return

    def name(self) -> str:
        start = self.i
        while self.i < len(self.p) and self.p[self.i] in NAME_CHARS:
            self.i += 1
        return self.p[start : self.i]

    def at_rule_start(self) -> bool:
        # `name ::=` ahead: the current rule has ended
        save = self.i
        ok = bool(self.name())
        self.skip()
        ok = ok and self.p.startswith("::=", self.i)
        self.i = save
        return ok

    def rules(self) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        self.skip()
        while self.i < len(self.p):
            name = self.name()
            if not name:
                raise self.fail(f"a rule name expected, got {self.p[self.i]!r}")
            self.skip()
            if not self.p.startswith("::=", self.i):
                raise self.fail(f"'::=' expected after {name!r}")
            self.i += 3
            if name in out:
                raise self.fail(f"rule {name!r} is defined twice")
            out[name] = self.alternation()
            self.skip()
            if self.peek() == ")":
                raise self.fail("unbalanced ')'")
        return out

    def sequence(self) -> tuple:
        items = []
        while True:
            self.skip()
            if self.peek() in (None, "|", ")") or self.at_rule_start():
                return ("seq", items)
            items.append(self.repeat(self.atom()))

    def repeat(self, node: tuple) -> tuple:
        self.skip()
        return super().repeat(node)

    def atom(self) -> tuple:
        c = self.peek()
        if c == '"':
            self.take()
            chars = []
            while self.peek() != '"':
                if self.peek() is None:
                    raise self.fail("an unterminated string")
                ch = self.take()
                chars.append(
                    ("set", self.escape(in_class=False) if ch == "\\" else [(ord(ch),) * 2])
                )
            self.take()
            return ("seq", chars)
        if c == "(":
            self.take()
            inner = self.alternation()
            self.skip()
            if self.peek() != ")":
                raise self.fail("missing ')'")
            self.take()
            return inner
        if c == "[":
            self.take()
            return ("set", self.klass())
        if c == ".":
            self.take()
            return ("set", _negate([]))
        name = self.name()
        if not name:
            raise self.fail(f"unexpected {c!r}")
        return ("ref", name)


def _nullable(node: tuple, null: dict[str, bool]) -> bool:
    kind = node[0]
    if kind == "set":
        return False
    if kind == "ref":
        return null.get(node[1], False)
    if kind == "seq":
        return all(_nullable(x, null) for x in node[1])
    if kind == "alt":
        return any(_nullable(x, null) for x in node[1])
    return node[2] == 0 or _nullable(node[1], null)


def _first_refs(node: tuple, null: dict[str, bool]) -> set[str]:
    # the rules a sentence of node can begin with a call of (before any character)
    kind = node[0]
    if kind == "set":
        return set()
    if kind == "ref":
        return {node[1]}
    if kind == "alt":
        return set().union(*(_first_refs(x, null) for x in node[1]))
    if kind == "rep":
        return _first_refs(node[1], null)
    out: set[str] = set()
    for x in node[1]:
        out |= _first_refs(x, null)
        if not _nullable(x, null):
            break
    return out


def _check_left_recursion(rules: dict[str, tuple]) -> None:
    # a rule that can call itself before reading a character would nest calls to the depth bound
    # at every step (as llama.cpp's GBNF, it is refused)
    null = dict.fromkeys(rules, False)
    while True:  # the nullable rules, to a fixed point
        new = {name: _nullable(tree, null) for name, tree in rules.items()}
        if new == null:
            break
        null = new
    first = {name: _first_refs(tree, null) & set(rules) for name, tree in rules.items()}
    for name in rules:
        seen, todo = set(), list(first[name])
        while todo:
            r = todo.pop()
            if r == name:
                raise SchemaError(f"grammar: rule {name!r} is left-recursive; write it with repetition "
                                  f"(expr ::= term (\"+\" term)*)")  # fmt: skip
            if r not in seen:
                seen.add(r)
                todo.extend(first[r])


@lru_cache(maxsize=64)
def compile_grammar(text: str) -> Automaton:
    """The automaton of a grammar's `root` rule (SchemaError for a grammar it cannot take)."""
    if not isinstance(text, str):
        raise SchemaError(f"a grammar must be a string, got {text!r}")
    rules = _Grammar(text).rules()
    if "root" not in rules:
        raise SchemaError("grammar: no rule named 'root'")
    _check_left_recursion(rules)
    a = Automaton()
    entries: dict[str, int] = {}

    def ref(name: str) -> tuple[int, int]:
        # a call of the rule's subroutine (built on its first call)
        if name not in rules:
            raise SchemaError(f"grammar: rule {name!r} is not defined")
        if name not in entries:
            entries[name] = entry = a.node()
            end = a.node()
            a.ret.add(end)
            a.seq((entry, entry), _piece(a, rules[name], False, ref), (end, end))
        return a.calls(entries[name])

    a.finish(ref("root"), ws=False)
    return a
