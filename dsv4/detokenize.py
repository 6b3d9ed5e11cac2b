"""Incremental detokenization: token ids -> streamed text deltas, O(1) work per step."""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence
# prompt tokens kept as left context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
PROMPT_WINDOW = 5


class IncrementalDetokenizer:
    """Streamed text deltas via prefix/read offsets: decode a short window twice and diff."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # only the window ids[prefix_offset:] is kept (prefix_offset is 0 in this list), so memory
        # and decode cost stay O(window): ids[:read_offset] is left context already emitted (or
        # prompt) and ids[read_offset:] has not been emitted yet
        self._ids = list(prompt_ids[-PROMPT_WINDOW:])
        self._read_offset = len(self._ids)
        self._sent = 0  # chars past the read offset already returned while a character was partial

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Append ids; return the newly completed text (a partial UTF-8 character is held back)."""
        self._ids.extend(new_token_ids)
        # decode the context and the window separately instead of slicing one decode: tokenizers
        # such as Metaspace drop a leading space at the start of a decode. A trailing U+FFFD in
        # the context can only come from a prompt that ends mid-character; strip it so that the
        # character is emitted whole once the output completes it.
        context = self._decode(self._ids[: self._read_offset])
        prefix_text = context.rstrip(REPLACEMENT)
        new_text = self._decode(self._ids)
        if len(new_text) <= len(prefix_text):
            return ""  # nothing new yet (e.g. a skipped special token)
        # text before a trailing U+FFFD is final; the U+FFFD run may still become a character
        stable = new_text.rstrip(REPLACEMENT)
        start = len(prefix_text) + self._sent
        delta = new_text[start : len(stable)] if len(stable) > start else ""
        if len(stable) < len(new_text):
            self._sent += len(delta)  # offsets stay put until the character completes
            return delta
        # every character is complete: the unread ids become the next context. Keep the old
        # context while it ends mid-character, so the next context starts on a character boundary.
        if not context.endswith(REPLACEMENT):
            del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._sent = 0
        return delta
