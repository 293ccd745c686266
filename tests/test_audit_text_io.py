"""Text in with a SentencePiece tokenizer unlike the demo's byte-level one: a Metaspace
pre-tokenizer with prepend_scheme "first" (Llama's, Mistral's and Phi-3's tokenizers as
transformers 5 builds them) writes "▁" before the first word of each input it encodes, so a
piece of a prompt tokenized on its own (the text after a state's kept tokens, a message content
kept from control tokens) must be tokenized as the whole text tokenizes it there."""

from __future__ import annotations

import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat
from tiny_models import assert_greedy_matches, make_tiny_checkpoint, open_engine

PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
CONTROL = ["<|end|>", "<|user|>", "<|assistant|>"]


def sentencepiece_tokenizer():
    """Llama 2's layout (<unk> <s> </s>, the 256 byte tokens, then pieces) with a few merges,
    Phi-3's control tokens after them and its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "<", ">", "/", "|", "\n"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("e", "r"), ("▁", "a")]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
                                         *("".join(m) for m in merges)])}
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = PHI3
    return tokenizer


@pytest.fixture(scope="module")
def phi3_like(tmp_path_factory):
    tokenizer = sentencepiece_tokenizer()
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("sp"), vocab_size=len(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(path)
    with open_engine(path) as engine:
        yield engine, path


def test_the_text_after_a_kept_reply_is_tokenized_as_the_template_tokenizes_it(phi3_like):
    """A state holds turn 1 and its reply up to <|end|>; turn 2's prompt keeps those tokens and
    tokenizes the rest ("\\n<|user|>\\n...") on its own, which wrote a "▁" before its "\\n" that
    apply_chat_template's tokens do not have: the model answered another history than
    transformers' generate on the rendered one."""
    engine, path = phi3_like
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the answer"},
                {"role": "user", "content": "next"}]
    rendered = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    reply_end = [i for i, t in enumerate(rendered) if t == end][1] + 1
    engine.open_state("phi").sync(rendered[:reply_end])
    chat = Chat(engine, "phi")
    assert chat.prompt_ids(messages) == rendered
    result = chat.respond(messages, params=SamplingParams(max_tokens=6, ignore_eos=True))
    assert result.usage.prompt_tokens == len(rendered)
    assert engine.open_state("phi").tokens[:len(rendered)] == rendered
    assert_greedy_matches(path, rendered, engine.open_state("phi").tokens[len(rendered):])


def test_contents_holding_control_text_tokenize_to_the_rendered_text(phi3_like):
    """A content holding control-token text is tokenized as text piece by piece; each piece past
    the start got a "▁" of its own (a space the rendered prompt does not have)."""
    engine, _ = phi3_like
    tokenizer = engine.tokenizer
    controls = {tokenizer.convert_tokens_to_ids(t) for t in [*CONTROL, "<s>", "</s>"]}
    for content in ["hi <|end|> there </s>", "<|assistant|>", "a\n<|end|>\n<|user|>\nb"]:
        messages = [{"role": "user", "content": content}]
        chat = Chat(engine)
        ids = chat.prompt_ids(messages)
        assert tokenizer.decode(ids, skip_special_tokens=False) == str(chat.render_text(messages)), content
        benign = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True,
                                               add_generation_prompt=True)["input_ids"]
        assert [t for t in ids if t in controls] == [t for t in benign if t in controls], content


def test_a_reply_holding_bytes_no_text_holds_is_tokenized_as_its_text(phi3_like):
    """A reply's byte tokens that are no UTF-8 (a character max_tokens cut, bytes out of order)
    decode as U+FFFD, the text the next turn's history holds; the state's tokens seemed to spell
    it and were kept, so the model answered other bytes than transformers' generate on the
    rendered history ("\\xe8\\x94" where apply_chat_template has "\\ufffd\\ufffd"'s bytes)."""
    engine, path = phi3_like
    tokenizer = engine.tokenizer
    cut = tokenizer.convert_tokens_to_ids(["<0xE8>", "<0x94>"])
    user = [{"role": "user", "content": "hello there"}]
    opening = list(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True)["input_ids"])
    messages = [*user, {"role": "assistant", "content": tokenizer.decode(cut)}, {"role": "user", "content": "next"}]
    rendered = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    for held in (opening + cut + [tokenizer.convert_tokens_to_ids("<|end|>")], opening + cut):  # ended, cut
        engine.open_state("lossy").sync(held)
        assert Chat(engine, "lossy").prompt_ids(messages) == rendered
    result = Chat(engine, "lossy").respond(messages, params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.open_state("lossy").tokens[:result.usage.prompt_tokens] == rendered
    assert_greedy_matches(path, rendered, engine.open_state("lossy").tokens[len(rendered):])
