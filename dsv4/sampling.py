"""Sampling: vLLM-compatible SamplingParams, a batched Sampler, and the per-request StopChecker."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.automaton import Automaton, SchemaError
from dsv4.dsml_grammar import compile_tool_calls
from dsv4.ebnf import compile_grammar
from dsv4.json_schema import compile_choice, compile_schema
from dsv4.regex import compile_regex

# the fields that constrain the output (one at a time; `SamplingParams.automaton`)
STRUCTURED = ("json_object", "json_schema", "guided_choice", "guided_regex", "guided_grammar",
              "tool_calls")  # fmt: skip
MASK_CACHE = 128  # constraint masks kept on the device (~129 KB each at 129K tokens)
# temperature below this is greedy (vLLM's _SAMPLING_EPS); dividing by ~0 would overflow fp32
GREEDY_EPS = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass
class SamplingParams:
    """Per-request sampling and stop settings, named as in vLLM's SamplingParams."""

    n: int = 1  # completions per prompt (`LLM.generate` and the server run n requests)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None = until EOS or the context limit
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalized to list[str]
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs; 0 = only the chosen token's
    # each prompt token's logprob (and the top n) given the tokens before it; the first: None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # added to the logits before anything else (OpenAI's logit_bias: token id -> [-100, 100])
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # the output is one JSON object (response_format json_object): `dsv4.grammar` masks each step
    json_object: bool = False
    # (trigger id, ids): once the trigger token is out, these tokens follow, and EOS waits for
    # them (a forced tool call after thinking mode's `</think>`: `dsv4.grammar.forced_after`)
    forced_after: tuple[int, list[int]] | None = None
    # structured outputs (`dsv4.json_schema`): the output is an instance of this JSON schema
    # (response_format json_schema, vLLM's guided_json; a dict, a bool or its JSON text),
    # exactly one of these strings (vLLM's guided_choice), a match of this regex (guided_regex,
    # `dsv4.regex`) or a sentence of this grammar's root rule (guided_grammar, `dsv4.ebnf`)
    json_schema: dict | bool | str | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # tool_choice "required" / named: {"tools": [...], "name": str | None, "parallel": bool}, the
    # arguments of the forced DSML call constrained by the tools' schemas (`dsv4.dsml_grammar`)
    tool_calls: dict | None = None
    # JSON mode / structured output from the token after this one (thinking mode: `</think>`;
    # the reasoning before it is free, and EOS waits for it)
    constrain_after: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

        _check(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        t = self.temperature
        _check(
            isinstance(t, (int, float)) and math.isfinite(t) and t >= 0,
            f"temperature must be a finite number >= 0, got {t!r}",
        )
        _check(
            _is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
            f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        r = self.repetition_penalty
        _check(
            isinstance(r, (int, float)) and math.isfinite(r) and r > 0,
            f"repetition_penalty must be a finite number > 0, got {r!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(
                isinstance(v, (int, float)) and -2 <= v <= 2,
                f"{name} must be in [-2, 2], got {v!r}",
            )
        _check(self.seed is None or _is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be non-empty strings, got {self.stop!r}",
        )
        _check(
            all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
            f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and v >= 0), f"{name} must be >= 0, got {v!r}")
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            _check(
                all(
                    _is_int(t) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                    for t, b in self.logit_bias.items()
                ),
                f"logit_bias must map token ids >= 0 to values in [-100, 100], "
                f"got {self.logit_bias!r}",
            )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(
                bool(self.allowed_token_ids)
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                f"allowed_token_ids must be a non-empty list of token ids >= 0, "
                f"got {self.allowed_token_ids!r}",
            )

        if self.forced_after is not None:
            trigger, ids = self.forced_after
            self.forced_after = (trigger, list(ids))
            _check(
                _is_int(trigger) and trigger >= 0 and bool(ids)
                and all(_is_int(t) and t >= 0 for t in ids),
                f"forced_after must be (token id, non-empty list of token ids), got {self.forced_after!r}",
            )  # fmt: skip
        asked = [name for name in STRUCTURED if getattr(self, name) not in (None, False)]
        _check(len(asked) <= 1, f"{asked[-1]} cannot be combined with {asked[0]}" if asked else "")
        _check(
            self.forced_after is None or asked in ([], ["tool_calls"]),
            f"forced_after cannot be combined with {asked[0] if asked else ''}",
        )
        if self.constrain_after is not None:
            _check(
                _is_int(self.constrain_after) and self.constrain_after >= 0
                and bool(asked) and self.forced_after is None,
                f"constrain_after must be a token id, with json_object or a structured output, "
                f"got {self.constrain_after!r}",
            )  # fmt: skip
        try:
            self.automaton()  # a schema it cannot constrain to fails here, by name
        except SchemaError as e:
            raise ValueError(f"{asked[0]}: {e}") from None

    def answer_after(self, token: int) -> SamplingParams:
        """Thinking mode: JSON mode / a structured output constrains the answer from the token
        after `token` (`</think>`), the reasoning before it free; other params as they are."""
        if self.constrained and self.constrain_after is None:
            return dataclasses.replace(self, constrain_after=token)
        return self

    @property
    def constrained(self) -> bool:
        """JSON mode or a structured output (not a forced continuation)."""
        return self.json_object or self.automaton() is not None

    def automaton(self) -> Automaton | None:
        """The structured-output automaton of json_schema / guided_choice / guided_regex /
        guided_grammar (compiled once per value)."""
        if self.json_schema is not None:
            return compile_schema(self.json_schema)
        if self.guided_choice is not None:
            return compile_choice(self.guided_choice)
        if self.guided_regex is not None:
            return compile_regex(self.guided_regex)
        if self.guided_grammar is not None:
            return compile_grammar(self.guided_grammar)
        if self.tool_calls is not None:
            t = self.tool_calls
            return compile_tool_calls(t.get("tools"), t.get("name"), t.get("parallel", True))
        return None

    def token_ids(self) -> list[int]:
        """The token ids the settings name (for the vocabulary check of `Engine.add_request`)."""
        forced = [self.forced_after[0], *self.forced_after[1]] if self.forced_after else []
        forced += [self.constrain_after] if self.constrain_after is not None else []
        return list(self.logit_bias or ()) + list(self.allowed_token_ids or ()) + forced

    def choice(self, j: int) -> SamplingParams:
        """The params of completion j of n: one request's, seed + j for a seeded request (its
        completions differ and each is reproducible)."""
        seed = self.seed if self.seed is None else self.seed + j
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request RNG for a seeded request; it must live on the logits' device."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SampleOutput:
    """Sampled ids plus raw-model logprobs (log_softmax of unprocessed logits, vLLM's default)."""

    token_ids: Tensor  # [B] int64
    # speculative decoding: [B] bool, the row's draft token was accepted (token_ids holds it)
    accepted: Tensor | None = None
    logprobs: Tensor | None = None  # [B] fp32 logprob of token_ids; None unless some row asked
    # [B, n] int64, n = max requested; row i reads [: params[i].logprobs]
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None  # [B, n] fp32, descending


def _token_counts(ids: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    # -> [B, V] fp32 occurrence counts; the flat ids travel to the device, not the [B, V] table
    flat = torch.tensor([t for row in ids for t in row], dtype=torch.long).to(device)
    rows = torch.repeat_interleave(
        torch.arange(len(ids)), torch.tensor([len(row) for row in ids], dtype=torch.long)
    ).to(device)
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    return counts.index_put_(
        (rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True
    )


def apply_penalties(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> Tensor:
    """vLLM penalties on logits [B, V] fp32; returns a new tensor (logits itself if none apply)."""
    if all(
        p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
        for p in params
    ):
        return logits
    B, V = logits.shape
    dev = logits.device
    out_counts = _token_counts(output_ids, V, dev)  # [B, V]
    if any(p.repetition_penalty != 1 for p in params):
        # only rows with a repetition penalty need their (possibly long) prompt scattered
        prompts = [prompt_ids[i] if p.repetition_penalty != 1 else [] for i, p in enumerate(params)]
        seen = (_token_counts(prompts, V, dev) > 0) | (out_counts > 0)  # [B, V] bool
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)
        r = torch.where(seen, rep[:, None], 1.0)  # [B, V]
        # divide positive logits, multiply negative ones: both push seen tokens down for r > 1
        logits = torch.where(logits > 0, logits / r, logits * r)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)
    return logits - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0)


class Sampler:
    """Next token per row from last-position logits, processed in vLLM v1's order."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        # constraint masks on the logits' device, by the host mask they copy (the grammars
        # cache a mask per state, so a state's mask is the same tensor each step): (host,
        # device) most recent last, at most MASK_CACHE (H200, 64 constrained rows: 1.53 ms a
        # step with the copies, 0.18 with the masks on the GPU; docs/PERF.md)
        self._masks: OrderedDict[int, tuple[Tensor, Tensor]] = OrderedDict()

    def mask_min_tokens(
        self, logits: Tensor, params: list[SamplingParams], output_ids: list[list[int]]
    ) -> Tensor:
        # EOS (unless ignore_eos) and stop_token_ids get -inf until min_tokens tokens exist
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_tokens:
                stops = p.stop_token_ids + ([] if p.ignore_eos else [self.eos_token_id])
                rows += [i] * len(stops)
                cols += stops
        if not rows:
            return logits
        idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(idx, torch.tensor(-math.inf, device=logits.device))

    def _on_device(self, mask: Tensor, device: torch.device) -> Tensor:
        if mask.device == device:
            return mask
        hit = self._masks.get(id(mask))
        if hit is not None and hit[0] is mask:
            self._masks.move_to_end(id(mask))
            return hit[1]
        self._masks[id(mask)] = (mask, mask.to(device))  # (the host tensor kept: its id stays)
        if len(self._masks) > MASK_CACHE:
            self._masks.popitem(last=False)
        return self._masks[id(mask)][1]

    def constrain(
        self, logits: Tensor, output_ids: list[list[int]], constraints: list | None
    ) -> Tensor:
        # constrained decoding (a `dsv4.grammar` constraint per row, None for free
        # rows): the tokens the constraint does not allow get -inf
        rows = [i for i, c in enumerate(constraints or []) if c is not None]
        masks = [constraints[i].mask(output_ids[i]) for i in rows]
        rows = [i for i, m in zip(rows, masks) if m is not None]
        if not rows:
            return logits
        keep = torch.stack([self._on_device(m, logits.device) for m in masks if m is not None])
        idx = torch.tensor(rows, device=logits.device)
        return logits.index_put((idx,), logits[idx].masked_fill(~keep, -math.inf))

    @staticmethod
    def bias(logits: Tensor, params: list[SamplingParams]) -> Tensor:
        # allowed_token_ids: every other token -inf; then logit_bias added
        dev = logits.device
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if allowed:
            keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool, device=dev)
            for j, i in enumerate(allowed):
                keep[j, params[i].allowed_token_ids] = True
            rows = torch.tensor(allowed, device=dev)
            logits = logits.index_put((rows,), logits[rows].masked_fill(~keep, -math.inf))
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for t, b in (p.logit_bias or {}).items():
                rows.append(i)
                cols.append(t)
                vals.append(float(b))
        if rows:
            idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            logits = logits.index_put(idx, torch.tensor(vals, device=dev), accumulate=True)
        return logits

    def process(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        constraints: list | None = None,
    ) -> Tensor:
        """Processed logits [B, V] fp32: softmax = sampling distribution (greedy rows: argmax).
        constraints: a `dsv4.grammar` constraint per row (None: free), or None."""
        # constraints (JSON mode, structured outputs) and the min_tokens mask -> allowed_token_ids,
        # logit_bias -> penalties -> temperature -> min_p -> top_k -> top_p (vLLM v1 order);
        # greedy rows stop after the penalties
        B, V = logits.shape
        dev = logits.device
        constrained = self.constrain(logits, output_ids, constraints)
        logits = self.mask_min_tokens(constrained, params, output_ids)
        if any(c is not None and len(o) < p.min_tokens
               for c, o, p in zip(constraints or [], output_ids, params)):  # fmt: skip
            # a complete constrained output may allow only EOS: it ends there, min_tokens or not
            # (a row with no token left would sample garbage)
            logits = torch.where(torch.isneginf(logits).all(-1, keepdim=True), constrained, logits)
        logits = self.bias(logits, params)
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
        if all(p.greedy for p in params):
            return logits
        # greedy rows ride along with neutral settings: T=1, no filters (argmax is unchanged)
        temp = [1.0 if p.greedy else p.temperature for p in params]
        logits = logits / torch.tensor(temp, dtype=torch.float32, device=dev)[:, None]

        min_p = [0.0 if p.greedy else p.min_p for p in params]
        if any(min_p):
            probs = logits.softmax(-1)  # [B, V]
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < thresh, -math.inf)

        top_k = [p.top_k if not p.greedy and 0 < p.top_k < V else V for p in params]
        top_p = [p.top_p if not p.greedy and p.top_p < 1 else math.inf for p in params]
        if any(k < V for k in top_k) or any(p < 1 for p in top_p):
            # stable descending sort: ties keep the lower index first, so top_k keeps exactly k
            # tokens and breaks ties like greedy does
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
            pos = torch.arange(V, device=dev)
            k = torch.tensor(top_k, device=dev)[:, None]
            sorted_logits = sorted_logits.masked_fill(pos >= k, -math.inf)
            if any(p < 1 for p in top_p):
                # top_p over the top_k-renormalized distribution: keep the smallest prefix whose
                # mass reaches p, i.e. drop a token once the mass before it is already >= p
                sp = sorted_logits.softmax(-1)
                mass_before = sp.cumsum(-1) - sp
                p = torch.tensor(top_p, device=dev)[:, None]
                sorted_logits = sorted_logits.masked_fill(mass_before >= p, -math.inf)
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        return logits

    @torch.no_grad()
    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        drafts: list[int] | None = None,
        constraints: list | None = None,
    ) -> SampleOutput:
        """One token per row. With `drafts` (a proposed token per row, -1 for none), each row
        verifies its draft first (speculative decoding with a deterministic draft): the draft is
        accepted with probability p(draft), greedy rows iff it is the argmax; a rejected draft
        is replaced by a draw from p with the draft removed, renormalized. Either way the row's
        token is distributed exactly as p."""
        B, V = logits.shape
        assert logits.dtype == torch.float32, f"logits must be fp32, got {logits.dtype}"
        assert len(params) == len(prompt_ids) == len(output_ids) == len(generators) == B, (
            f"batch mismatch: logits B={B}, params={len(params)}, prompt_ids={len(prompt_ids)}, "
            f"output_ids={len(output_ids)}, generators={len(generators)}"
        )
        dev = logits.device
        processed = self.process(logits, params, prompt_ids, output_ids, constraints)  # [B, V]
        token_ids = processed.argmax(-1)  # [B]; torch.argmax returns the first maximal index
        accepted = None
        if drafts is not None:
            draft = torch.tensor(drafts, dtype=torch.long, device=dev)
            has = draft >= 0
            accepted = has & (token_ids == draft)  # greedy rows; random rows below
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if rand_rows:
            # exponential race: argmax(p / q), q ~ Exp(1), draws i with probability p_i (equivalent
            # to Gumbel-max). Unseeded rows share one draw; a seeded row redraws its own [V] noise
            # from its generator, so its tokens do not depend on the rest of the batch.
            probs = processed.softmax(-1)
            is_rand = torch.zeros(B, dtype=torch.bool)
            is_rand[rand_rows] = True
            is_rand = is_rand.to(dev)
            if drafts is not None:
                # accept the draft with probability p(draft); a rejection draws from the rest
                u = torch.rand(B, device=dev)
                for i in rand_rows:
                    if generators[i] is not None:
                        u[i : i + 1].uniform_(generator=generators[i])
                p_draft = probs.gather(-1, draft.clamp(min=0)[:, None]).squeeze(-1)
                accepted = torch.where(is_rand, has & (u < p_draft), accepted)
                rest = probs.scatter(-1, draft.clamp(min=0)[:, None], 0.0)
                probs = torch.where(has[:, None], rest, probs)
            q = torch.empty_like(probs).exponential_()
            for i in rand_rows:
                if generators[i] is not None:
                    q[i].exponential_(generator=generators[i])
            q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would turn a masked 0/0 into nan
            sampled = probs.div(q).argmax(-1)
            token_ids = torch.where(is_rand, sampled, token_ids)
        if accepted is not None:
            token_ids = torch.where(accepted, draft, token_ids)

        out = SampleOutput(token_ids=token_ids, accepted=accepted)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            raw = logits.log_softmax(-1)  # [B, V] fp32: raw-model logprobs, before any processing
            out.logprobs = raw.gather(-1, token_ids[:, None]).squeeze(-1)
            out.top_logprobs, out.top_ids = raw.topk(min(max(asked), V), dim=-1)
        return out


@dataclass
class StopResult:
    """What one StopChecker.step decided."""

    delta: str  # text safe to stream now (possible stop-string beginnings are held back)
    finish_reason: str | None  # "stop" | "length" | None (still running)
    num_tokens: int  # how many of the step's ids belong to the output; the rest came after a stop
    stop_reason: int | str | None = None  # the stop token id or stop string; None: EOS or length


class StopChecker:
    """Per-request finish rule: EOS, stop_token_ids, stop strings, max_tokens."""

    def __init__(self, params: SamplingParams, eos_token_id: int | None) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.num_tokens = 0  # output tokens seen, stopping token included
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._stop_ids = set(params.stop_token_ids)
        self._constrained = params.constrained
        self._streamed: list[str] = []  # deltas returned so far
        # text not streamed yet. A stop string that ends in new text starts inside it: its start
        # was a held tail (a stop-string prefix), so the search never looks at streamed text and
        # each step costs O(held + new) however long the output is.
        self._pending = ""

    @property
    def output_text(self) -> str:
        return "".join(self._streamed)

    def step(self, new_token_ids: list[int], detokenize: Callable[[list[int]], str]) -> StopResult:
        """Consume new ids one at a time; detokenize (e.g. IncrementalDetokenizer.step) gives the
        text of each id that is not itself a stop token."""
        assert self.finish_reason is None, f"step() after finish ({self.finish_reason})"
        p = self.params
        for n, tok in enumerate(new_token_ids, 1):
            self.num_tokens += 1
            # the first min_tokens tokens never stop the request (the Sampler masks stop ids too),
            # but for an EOS that a complete constrained output left as its only token
            can_stop = self.num_tokens > p.min_tokens
            is_eos = tok == self.eos_token_id and not p.ignore_eos
            if (can_stop or (is_eos and self._constrained)) and (is_eos or tok in self._stop_ids):
                # a stop token ends the output and its text is not part of it
                return self._finish(n, "stop", None if is_eos else tok)
            old_len = len(self._pending)
            self._pending += detokenize([tok])
            if can_stop and (hit := self._find_stop(old_len)) is not None:
                # trim just before the stop string (or just after it)
                keep = len(hit[1]) if p.include_stop_str_in_output else 0
                self._pending = self._pending[: hit[0] + keep]
                return self._finish(n, "stop", hit[1])
            if p.max_tokens is not None and self.num_tokens >= p.max_tokens:
                return self._finish(n, "length", None)
        held = self._held()
        delta = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(delta) :]
        self._streamed.append(delta)
        return StopResult(delta, None, len(new_token_ids))

    def _finish(self, n: int, reason: str, stop_reason: int | str | None) -> StopResult:
        # held-back text was not a stop string after all (or was trimmed off): release the rest
        delta, self._pending = self._pending, ""
        self._streamed.append(delta)
        self.finish_reason, self.stop_reason = reason, stop_reason
        return StopResult(delta, reason, n, stop_reason)

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        # earliest stop string that ends in the new text (earlier ends were checked before)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self._pending.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held(self) -> int:
        # length of the longest tail of pending text that is a proper prefix of a stop string
        held = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self._pending)), held, -1):
                if self._pending.endswith(s[:k]):
                    held = k
                    break
        return held
