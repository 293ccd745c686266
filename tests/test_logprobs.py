"""Log-probabilities of generated tokens (`SamplingParams.logprobs` / `top_logprobs`): the model's
raw distribution at each position, as transformers computes it, on the completion and on every
streamed event; asking for them never changes the tokens."""

from __future__ import annotations

import random

import pytest
import torch

import tiny_models
from hibana_core import SamplingParams
from hibana_core.errors import ConfigError

GEN = 12


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_models.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("logprobs") / "qwen3")


def prompt(seed: int, n: int = 20) -> list[int]:
    return tiny_models.random_tokens(random.Random(seed), n)


def test_params_are_checked():
    with pytest.raises(ConfigError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=3)
    with pytest.raises(ConfigError, match="top_logprobs must lie"):
        SamplingParams(logprobs=True, top_logprobs=21)


def test_greedy_logprobs_match_transformers(qwen3, make_engine):
    engine = make_engine(qwen3)
    history = prompt(1)
    plain = engine.open_state("plain")
    plain.sync(history)
    want = plain.generate(SamplingParams(max_tokens=GEN, ignore_eos=True))
    h = engine.open_state("lp")
    h.sync(history)
    got = h.generate(SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=True, top_logprobs=3))
    assert got.token_ids == want.token_ids and want.logprobs is None
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    for i, lp in enumerate(got.logprobs):
        ref = tiny_models.hf_next_logits(qwen3, history + got.token_ids[:i]).log_softmax(dim=-1)
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
        top_values, top_ids = ref.topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()        # greedy: the chosen token is the first
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert lp.top[0][0] == lp.token_id


def test_streamed_and_sampled_logprobs_in_a_mixed_batch(qwen3, make_engine):
    engine = make_engine(qwen3)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True, temperature=1.0, seed=5, logprobs=True)
    h = engine.open_state("s")
    h.sync(prompt(2))
    other = engine.open_state("o")   # a batch neighbour without logprobs
    other.sync(prompt(3))
    stream = h.stream(params)
    plain = other.generate(SamplingParams(max_tokens=GEN, ignore_eos=True))
    events = list(stream)
    *tokens, last = events
    assert [e.logprob.token_id for e in tokens] == [e.token_id for e in tokens] == last.completion.token_ids
    assert [e.logprob for e in tokens] == last.completion.logprobs
    assert all(e.logprob.top == () and e.logprob.logprob <= 0.0 for e in tokens)
    assert plain.logprobs is None
    # the seeded tokens are those of a run without logprobs
    again = engine.open_state("s2")
    again.sync(prompt(2))
    assert again.generate(SamplingParams(max_tokens=GEN, ignore_eos=True, temperature=1.0, seed=5)).token_ids \
        == last.completion.token_ids
    sampled = last.completion.logprobs
    history = prompt(2)
    for i in (0, GEN - 1):
        ref = tiny_models.hf_next_logits(qwen3, history + last.completion.token_ids[:i]).log_softmax(dim=-1)
        assert sampled[i].logprob == pytest.approx(float(ref[sampled[i].token_id]), abs=1e-4)


def test_logprobs_under_speculation(qwen3, make_engine):
    """Verified drafts get the logprobs of the rows that verified them."""
    engine = make_engine(qwen3)
    history = prompt(4) * 3            # repetitive: the suffix drafter proposes
    h = engine.open_state("spec")
    h.sync(history)
    got = h.generate(SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=True,
                                    speculation={"method": "suffix", "k": 4}))
    assert len(got.logprobs) == len(got.token_ids)
    for i in (0, len(got.token_ids) // 2, len(got.token_ids) - 1):
        ref = tiny_models.hf_next_logits(qwen3, history + got.token_ids[:i]).log_softmax(dim=-1)
        assert got.logprobs[i].token_id == got.token_ids[i]
        assert got.logprobs[i].logprob == pytest.approx(float(ref[got.token_ids[i]]), abs=1e-4)
    assert torch.tensor([lp.logprob for lp in got.logprobs]).le(0).all()
    assert engine.stats().draft_tokens_accepted > 0


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Gemma): a few pieces, "▁" for spaces, and every
    other character as its UTF-8 bytes in <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259}
    backend = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_token_bytes_are_the_tokens_own(kind):
    """OpenAI's logprobs "bytes": a token holding part of a character gives its own bytes, so the
    tokens' bytes joined are the text's (the decoded text of such a token alone is U+FFFD)."""
    from transformers import AutoTokenizer

    from hibana_core.detokenizer import token_bytes
    from hibana_core.loader import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR) if kind == "byte_level" else _byte_fallback_tokenizer()
    text = "a こんにちは 🌸 aé" if kind == "byte_fallback" else "こんにちは 🌸 東京 <tool_call> ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    raw = token_bytes(tokenizer)
    pieces = [raw(t) for t in ids]
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids), "no token holds part of a character"
    assert b"".join(pieces).decode("utf-8") == text
