"""Huge inputs through the chat layer (an outside tester of limits, second pass)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from hibana_core import ContextLengthError, Engine, SamplingParams
from hibana_core.chat import Chat, TokenIds
from hibana_core.token_floor import token_floor


@pytest.fixture(scope="module")
def demo():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", max_model_len=256,
                                num_blocks=64) as engine:
        yield engine


def _tool_turn(content: str) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": content}]


@pytest.mark.parametrize("lease", [False, True], ids=["own state", "leased"])
def test_a_tool_result_far_past_the_context_is_refused_before_it_is_tokenized(demo, monkeypatch, lease):
    """A 5-8 MB tool result was tokenized whole (seconds on a CPU) before it was refused as too
    long; it is refused at once, with the same ContextLengthError, the state unchanged."""
    chat = demo.chat("huge-result")
    chat.respond([{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=2))
    held = demo.open_state("huge-result").tokens
    encoded = []
    real = Chat._encode
    monkeypatch.setattr(Chat, "_encode", lambda self, text, start=0, after=None: encoded.append(len(text) - start)
                        or real(self, text, start, after))
    huge = "word " * 200_000  # 1 MB: its fewest tokens are far past 256
    with pytest.raises(ContextLengthError, match="more than the model's context of 256; shorten the history"):
        if lease:
            Chat(demo).respond(_tool_turn(huge), params=SamplingParams(max_tokens=2), lease=True)
        else:
            chat.respond(_tool_turn(huge), params=SamplingParams(max_tokens=2))
    assert not [n for n in encoded if n > 10_000]
    assert demo.open_state("huge-result").tokens == held
    # one just past the context is still tokenized, and refused as before
    with pytest.raises(ContextLengthError, match="exceed the model's context of 256"):
        chat.respond(_tool_turn("word " * 300), params=SamplingParams(max_tokens=2))
    assert demo.open_state("huge-result").tokens == held


def _fast(tok: Tokenizer, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab cde\n\t  xyz0123456789.,;:!?é\u0301\u1100\u1161\u11a8한中文😀<|>"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))) for _ in range(200)]


def _sentencepiece_like() -> Tokenizer:
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "b": 259,
             "▁a": 260, "ab": 261, "▁ab": 262}
    tok = Tokenizer(models.BPE(vocab, [("▁", "a"), ("a", "b"), ("▁", "ab")], unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _byte_level_nfc() -> Tokenizer:
    """A byte-level BPE under NFC (as Qwen2's), with a long token of one character and a long word."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = []
    for left, right in [("a", "b"), ("ab", "ab"), ("abab", "abab"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("ĠĠĠĠ", "ĠĠĠĠ"),
                        ("Ã", "©"), ("Ã©", "Ã©")]:
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>"])
    return tok


def test_token_floor_bounds_the_tokens_of_any_text_from_below(demo):
    """Where `token_floor` gives a bound, no text makes fewer tokens: the demo's byte-level BPE, a
    byte-level one under NFC, a SentencePiece-like BPE with byte fallback (and under NFC), on
    random texts of letters, spaces, combining marks, jamo, added tokens' text, long tokens."""
    nfc = _sentencepiece_like()
    nfc.normalizer = normalizers.Sequence([normalizers.NFC(), nfc.normalizer])
    for tokenizer in (demo.tokenizer, _fast(_byte_level_nfc()), _fast(_sentencepiece_like()), _fast(nfc)):
        floor = token_floor(tokenizer)
        assert floor is not None
        longest = max(tokenizer.get_vocab(), key=len)
        texts = [*_texts(0), longest * 50, " " * 300, "abab" * 80, "é" * 60, "\u1100\u1161\u11a8" * 40,
                 "e\u0301" * 40, "<|im_start|>" * 30 + "\u0301"]
        for text in texts:
            assert floor.least(text) <= len(tokenizer.encode(text, add_special_tokens=False)), (tokenizer, text)
    words = '{"id": 1234, "name": "a result row", "tags": ["x", "y"]}\n' * 100
    floor = token_floor(demo.tokenizer)  # (each character weighs by its own longest token, not the vocabulary's)
    assert floor.least(words) > 2 * len(words) // floor.span


def test_token_floor_gives_no_bound_where_a_token_can_stand_for_a_run_of_text():
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    word_piece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    word_piece.pre_tokenizer = pre_tokenizers.Whitespace()
    fused = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))
    dropping = Tokenizer(models.BPE({chr(c): c for c in range(256)}, []))
    dropping.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
    stripping = _sentencepiece_like()
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    bert_normalized = _sentencepiece_like()
    bert_normalized.normalizer = normalizers.BertNormalizer()
    for tok in (word_piece, fused, dropping, stripping, bert_normalized):
        assert token_floor(_fast(tok)) is None, tok
    assert len(_fast(fused).encode("zzzzzzzzzz", add_special_tokens=False)) == 1  # (why: one token for ten)


class _UnreadIds(TokenIds):
    """Token ids that fail the test when read one by one."""

    def __iter__(self):
        raise AssertionError("the ids were read one by one")


@pytest.mark.parametrize("lease", [False, True], ids=["own state", "leased"])
def test_token_ids_past_the_context_are_refused_before_each_is_checked(demo, lease):
    """respond(TokenIds(10M ids)) checked every id against the vocabulary, twice, before the
    length (4 s on a CPU); the length is checked first, the same ContextLengthError."""
    ids = _UnreadIds([5] * 300)
    with pytest.raises(ContextLengthError, match="300 tokens exceed the model's context of 256"):
        if lease:
            Chat(demo).respond(ids, params=SamplingParams(max_tokens=2), lease=True)
        else:
            demo.chat("many-ids").respond(ids, params=SamplingParams(max_tokens=2))


def test_a_prefill_far_past_the_context_is_refused_before_it_is_tokenized(demo, monkeypatch):
    """A 5 MB prefill was tokenized whole (8 s) before the prompt it made was refused."""
    encoded = []
    real = Chat._encode
    monkeypatch.setattr(Chat, "_encode", lambda self, text, start=0, after=None: encoded.append(len(text) - start)
                        or real(self, text, start, after))
    with pytest.raises(ContextLengthError, match="more than the model's context of 256"):
        demo.chat("huge-prefill").respond([{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=2),
                                          prefill="word " * 100_000)
    assert not [n for n in encoded if n > 10_000]
    assert demo.chat("huge-prefill").respond([{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=2),
                                             prefill="Sure").text.startswith("Sure")
