"""RequestOutput snapshots -> OpenAI completion / chat responses and stream chunks."""

from __future__ import annotations

import time

from dsv4.chat import THINK_END
from dsv4.engine import RequestOutput
from dsv4.parsers import ReasoningParser, StreamParser, merge_calls, merge_deltas


def usage_of(outs: list[RequestOutput], n: int = 1, fmts: list | None = None) -> dict:
    """Usage of one or several choices, n per prompt (in order): each prompt counted once, as
    vLLM; completion_tokens counts a stop token too (it was generated, as vLLM counts it);
    prompt_tokens_details.cached_tokens where the prefix cache found some; with the choices'
    formatters `fmts`, the reasoning's tokens of a thinking-mode chat as OpenAI's
    completion_tokens_details.reasoning_tokens (and SGLang's reasoning_tokens)."""
    n_in = sum(len(o.prompt_token_ids) for o in outs[::n])
    n_out = sum(len(o.token_ids) for o in outs)
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    cached = sum(o.num_cached_tokens for o in outs[::n])
    if cached:  # prefix caching found some: OpenAI's field
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    counts = [f.reasoning_tokens(o) for f, o in zip(fmts or [], outs)]
    if any(c is not None for c in counts):
        reasoning = sum(c or 0 for c in counts)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        usage["reasoning_tokens"] = reasoning
    return usage


class Formatter:
    """What completion and chat responses share: ids, token texts, usage options."""

    object_name = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer,  # noqa: ANN001 - tokenizers.Tokenizer or None
        *,
        eos_token_id: int | None = None,
        continuous_usage: bool = False,
        return_token_ids: bool = False,
        index: int = 0,
    ) -> None:
        self.id, self.model, self.tokenizer = request_id, model, tokenizer
        self.eos_token_id = eos_token_id  # the model's, which ends an output (matched_stop)
        self.index = index  # of this formatter's choice (n > 1 or several prompts: one each)
        self.created = int(time.time())
        self.continuous_usage = continuous_usage
        self.return_token_ids = return_token_ids
        self._num_logprobs = 0  # logprob entries already sent

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def new_logprobs(self, out: RequestOutput) -> dict | None:
        """Logprobs of the tokens not reported yet (None when the request did not ask)."""
        if out.logprobs is None:
            return None
        entries = out.logprobs[self._num_logprobs :]
        self._num_logprobs += len(entries)
        return self._logprobs(entries)

    def _logprobs(self, entries: list[dict]) -> dict:
        raise NotImplementedError

    def envelope(self, choices: list[dict], out: RequestOutput | None, chunk: bool) -> dict:
        body = {
            "id": self.id,
            "object": self.object_name + (".chunk" if chunk else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if out is not None and (not chunk or self.continuous_usage):
            body["usage"] = usage_of([out], fmts=[self])
        return body

    def reasoning_tokens(self, out: RequestOutput) -> int | None:
        """The tokens of `out` spent reasoning; None where the output has no reasoning part."""
        return None

    def matched_stop(self, out: RequestOutput) -> int | str | None:
        """SGLang's matched_stop: what ended a stopped output, the stop string or token id (the
        model's eos_token_id for EOS, as the stop rule reads it); None otherwise."""
        if out.finish_reason != "stop":
            return None
        return self.eos_token_id if out.stop_reason is None else out.stop_reason

    def usage_chunk(self, usage: dict) -> dict:
        """The final chunk of stream_options.include_usage: no choices, only usage."""
        return {**self.envelope([], None, chunk=True), "usage": usage}

    def response(self, out: RequestOutput) -> dict:
        return self.envelope([self.final_choice(out)], out, False)

    def final_choice(self, out: RequestOutput) -> dict:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """/v1/completions: `text` per choice, logprobs as {tokens, token_logprobs, top_logprobs}."""

    object_name = "text_completion"

    def __init__(
        self,
        *args,  # noqa: ANN002
        echo: str | None = None,
        prompt_logprobs: bool = False,
        **kwargs,  # noqa: ANN003
    ) -> None:
        super().__init__(*args, **kwargs)
        self._offset = 0  # chars of completion text before the next logprob entry
        self.echo = echo  # echo=true: the prompt's text, put before the first text sent
        self.prompt_logprobs = prompt_logprobs  # vLLM's field on the (non-streamed) choice

    def _logprobs(self, entries: list[dict]) -> dict:
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.token_text(e["token_id"]))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        top = [
            {self.token_text(t): lp for t, lp in e.get("top", [])} if "top" in e else None
            for e in entries
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _choice(self, out: RequestOutput, text: str, token_ids: list[int]) -> dict:
        logprobs = self.new_logprobs(out)
        if self.echo is not None:  # the first text sent: the prompt's comes before it
            text, self.echo = self.echo + text, None
            if logprobs is not None:
                logprobs = self._with_prompt(out, logprobs)
        choice = {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,  # vLLM's: the stop token id or string (None: EOS)
            "matched_stop": self.matched_stop(out),
        }
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _with_prompt(self, out: RequestOutput, logprobs: dict) -> dict:
        """echo with logprobs: the prompt tokens' entries (the first has no logprob) first."""
        self._offset = 0
        first = {"token_id": out.prompt_token_ids[0], "logprob": None}
        prompt = self._logprobs([first, *(out.prompt_logprobs or [None])[1:]])
        shift = self._offset  # the completion's offsets come after the prompt's text
        logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
        self._offset += sum(len(t) for t in logprobs["tokens"])
        return {k: prompt[k] + logprobs[k] for k in prompt}

    def chunk(self, out: RequestOutput) -> dict:
        """One SSE chunk for one engine step of this request."""
        return self.envelope([self._choice(out, out.delta_text, out.delta_token_ids)], out, True)

    def final_choice(self, out: RequestOutput) -> dict:
        choice = self._choice(out, out.text, out.token_ids)
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        return choice

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's form: per prompt token {token id: {logprob, rank, decoded_token}} for the
        token itself and the top n; None for the first."""
        rows: list[dict | None] = [None]
        for e in (out.prompt_logprobs or [None])[1:]:
            row = {e["token_id"]: (e["logprob"], e["rank"])}
            for r, (t, lp) in enumerate(e.get("top", []), 1):
                row.setdefault(t, (lp, r))
            rows.append(
                {
                    str(t): {"logprob": lp, "rank": r, "decoded_token": self.token_text(t)}
                    for t, (lp, r) in row.items()
                }
            )
        return rows


class _ReasoningOnly:
    """StreamParser's interface without tool parsing (no tools in the request)."""

    def __init__(self, thinking: bool) -> None:
        self.reasoning = ReasoningParser(thinking)

    @staticmethod
    def _deltas(reasoning: str, content: str) -> list[dict]:
        return ([{"reasoning_content": reasoning}] if reasoning else []) + (
            [{"content": content}] if content else []
        )

    def feed(self, delta: str) -> list[dict]:
        return self._deltas(*self.reasoning.feed(delta))

    def finish(self) -> list[dict]:
        return self._deltas(*self.reasoning.finish())


def _parser(
    thinking: bool, tools: list[dict] | None, parallel: bool
) -> StreamParser | _ReasoningOnly:
    return StreamParser(thinking, tools, parallel) if tools else _ReasoningOnly(thinking)


def _merge_into_one(deltas: list[dict]) -> dict:
    """Fold one step's parser deltas into a single chunk delta."""
    merged: dict = {}
    for d in deltas:
        for key in ("reasoning_content", "content"):
            if key in d:
                merged[key] = merged.get(key, "") + d[key]
        if "tool_calls" in d:
            merged.setdefault("tool_calls", []).extend(d["tool_calls"])
    if "tool_calls" in merged:  # one entry a call in a chunk, its pieces joined
        merged["tool_calls"] = merge_calls(merged["tool_calls"])
    return merged


class ChatFormatter(Formatter):
    """/v1/chat/completions: reasoning_content / content / tool_calls from the model's text."""

    object_name = "chat.completion"

    def __init__(
        self,
        *args,  # noqa: ANN002
        thinking: bool = False,
        tools: list[dict] | None = None,
        stream_reasoning: bool = True,
        prefill: str = "",
        parallel_tool_calls: bool = True,
        **kwargs,  # noqa: ANN003
    ) -> None:
        super().__init__(*args, **kwargs)
        self.thinking, self.tools = thinking, tools
        # OpenAI's parallel_tool_calls=false: the first call only (as vLLM keeps it)
        self.parallel = parallel_tool_calls
        # prefill: text the prompt made the reply begin with (a forced tool call's DSML start),
        # parsed ahead of the model's output
        self.prefill = prefill
        self._stream = _parser(thinking, tools, parallel_tool_calls)
        # (a named call's start: sent with the first chunk)
        self._pending = self._stream.feed(prefill)
        self._first = True
        self._called = False  # a tool call was streamed
        # SGLang's stream_reasoning=false: the reasoning is held back and sent in one delta when
        # the answer (content or a tool call) starts, or at the end
        self.stream_reasoning, self._held = stream_reasoning, ""
        tok = self.tokenizer
        end = tok.token_to_id(THINK_END) if thinking and tok is not None else None
        self._think_end = end  # the token that closes the reasoning
        # where it came (None: not yet, the ids before `_scanned` hold none): each call scans
        # only the new ids (usage on every chunk stays O(new tokens))
        self._end_at: int | None = None
        self._scanned = 0

    def reasoning_tokens(self, out: RequestOutput) -> int | None:
        # those before `</think>` (all of them while it has not come)
        if self._think_end is None:
            return None
        ids, end = out.token_ids, self._think_end
        at = self._end_at
        if at is not None and at < len(ids) and ids[at] == end:
            return at
        # (from the ids scanned last time when they can be the same output's)
        start = self._scanned if at is None and self._scanned <= len(ids) else 0
        try:
            self._end_at = ids.index(end, start)
        except ValueError:
            self._end_at, self._scanned = None, len(ids)
            return len(ids)
        return self._end_at

    def _hold_reasoning(self, deltas: list[dict], finished: bool) -> list[dict]:
        kept = []
        for d in deltas:
            if "reasoning_content" in d:
                self._held += d["reasoning_content"]
            else:
                kept.append(d)
        if self._held and (kept or finished):
            kept.insert(0, {"reasoning_content": self._held})
            self._held = ""
        return kept

    def _logprobs(self, entries: list[dict]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {
                    **item(e["token_id"], e["logprob"]),
                    "top_logprobs": [item(t, lp) for t, lp in e.get("top", [])],
                }
                for e in entries
            ]
        }

    def _finish_reason(self, out: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason

    def chunk(self, out: RequestOutput) -> dict:
        """One SSE chunk for one engine step: the first carries the role, the last finish_reason.

        Text the parsers hold back (a possible `</think>` or DSML tag) leaves the delta empty;
        the chunk is still sent, so clients see one chunk per generated token.
        """
        deltas, self._pending = self._pending + self._stream.feed(out.delta_text), []
        if out.finished:
            deltas += self._stream.finish()
        if not self.stream_reasoning:
            deltas = self._hold_reasoning(deltas, out.finished)
        delta = _merge_into_one(deltas)
        self._called |= "tool_calls" in delta
        if self._first:
            delta = {"role": "assistant", **delta}
            delta.setdefault("content", "")
            self._first = False
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": self.new_logprobs(out),
            "finish_reason": self._finish_reason(out, self._called) if out.finished else None,
            "stop_reason": out.stop_reason,
            "matched_stop": self.matched_stop(out),
        }
        if self.return_token_ids:
            choice["token_ids"] = out.delta_token_ids
        return self.envelope([choice], out, True)

    def final_choice(self, out: RequestOutput) -> dict:
        parser = _parser(self.thinking, self.tools, self.parallel)
        parsed = merge_deltas(parser.feed(self.prefill + out.text) + parser.finish())
        message = {
            "role": "assistant",
            "content": parsed["content"],
            "reasoning_content": parsed["reasoning_content"],
        }
        if parsed["tool_calls"]:
            message["tool_calls"] = parsed["tool_calls"]
        choice = {
            "index": self.index,
            "message": message,
            "logprobs": self.new_logprobs(out),
            "finish_reason": self._finish_reason(out, bool(parsed["tool_calls"])),
            "stop_reason": out.stop_reason,
            "matched_stop": self.matched_stop(out),
        }
        if self.return_token_ids:
            choice["token_ids"] = out.token_ids
        return choice


class NativeFormatter:
    """SGLang's /generate bodies: {text, output_ids, meta_info} with the text so far (a stream
    repeats the whole body after every step, as SGLang does by default). `logprobs`: None, or
    (logprob_start_len, top_logprobs_num, return_text_in_logprobs) of a return_logprob request;
    `index`: this body's place in a stream of several (None: one)."""

    def __init__(
        self,
        request_id: str,
        eos_token_id: int,
        tokenizer=None,  # noqa: ANN001 - tokenizers.Tokenizer or None
        logprobs: tuple[int, int, bool] | None = None,
        index: int | None = None,
        version: str = "default",
    ) -> None:
        self.id, self.eos_token_id, self.tokenizer = request_id, eos_token_id, tokenizer
        self.logprobs, self.index, self.version = logprobs, index, version
        # the lists so far (a stream repeats them whole: each token's entry made once)
        self._out: list = []
        self._out_top: list = []
        self._in: dict | None = None

    def _finish(self, out: RequestOutput) -> dict | None:
        if out.finish_reason == "length":
            return {"type": "length", "length": len(out.token_ids)}
        if out.finish_reason == "stop":
            matched = self.eos_token_id if out.stop_reason is None else out.stop_reason
            return {"type": "stop", "matched": matched}
        if out.finish_reason is not None:
            return {"type": out.finish_reason}
        return None

    def _item(self, logprob: float | None, token_id: int) -> list:
        # SGLang's [logprob, token id, text or None]
        with_text = self.logprobs[2] and self.tokenizer is not None
        text = self.tokenizer.decode([token_id], skip_special_tokens=False) if with_text else None
        return [logprob, token_id, text]

    def _top(self, entry: dict | None) -> list | None:
        return None if entry is None else [self._item(lp, t) for t, lp in entry.get("top", [])]

    def _logprobs(self, out: RequestOutput) -> dict:
        start, top_n, _ = self.logprobs
        new = (out.logprobs or [])[len(self._out) :]
        self._out += [self._item(e["logprob"], e["token_id"]) for e in new]
        meta = {"output_token_logprobs": self._out}
        if top_n:
            self._out_top += [self._top(e) for e in new]
            meta["output_top_logprobs"] = self._out_top
        if start >= 0 and self._in is None and out.prompt_logprobs is not None:
            ids = out.prompt_token_ids[start:]
            entries = out.prompt_logprobs[start:]
            self._in = {
                "input_token_logprobs": [
                    self._item(None if e is None else e["logprob"], t) for t, e in zip(ids, entries)
                ]
            }
            if top_n:
                self._in["input_top_logprobs"] = [self._top(e) for e in entries]
        if start >= 0:  # (until the prompt is in, its logprobs come with its last chunk: empty)
            meta |= self._in or {"input_token_logprobs": []}
        return meta

    def response(self, out: RequestOutput) -> dict:
        body = {
            "text": out.text,
            "output_ids": list(out.token_ids),
            "meta_info": {
                "id": self.id,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(out.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "finish_reason": self._finish(out),
                "weight_version": self.version,
            },
        }
        if self.logprobs is not None:
            body["meta_info"] |= self._logprobs(out)
        if self.index is not None:
            body["index"] = self.index
        return body

    chunk = response  # a stream chunk is the whole body so far
