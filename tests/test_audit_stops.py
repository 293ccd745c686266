"""How a generation stops and which defaults it takes, tested from outside on checkpoints unlike the
suite's own: a Qwen2.5-style ChatML checkpoint whose generation_config.json names two ends of
sequence ([<|im_end|>, <|endoftext|>]), a Llama 3.1-style list of three, generation configs that
set what transformers' `generate` applies to greedy output (Qwen2.5's repetition_penalty), and a
SentencePiece byte-fallback tokenizer whose characters span several tokens. Stop tokens and stop
strings are chosen from what the random model generates greedily (or forced with `force_outputs`),
and every output is held to transformers' `generate` on the same history."""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pytest
import torch

from hibana_core import ContextLengthError, SamplingParams
from hibana_core.chat import Chat, StreamedLogprobs, assistant_message
from hibana_core.speculation import force_outputs
from test_loader_eos import hf_generate  # generate on the checkpoint as transformers loads it
from tiny_models import (EOS_ID, assert_greedy_matches, hf_greedy, make_chat_checkpoint, make_tiny_checkpoint,
                         open_engine, random_tokens)

CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
SPECULATION = {"method": "suffix", "k": 6}


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A ChatML checkpoint whose generation config ends at <|im_end|> and at <|endoftext|> (id 0), as
    Qwen2.5's [151645, 151643]; its context is 96 tokens."""
    path = make_chat_checkpoint("qwen2", tmp_path_factory.mktemp("qwen_like"), CHATML,
                                special=["<|im_start|>", "<|im_end|>"], max_position_embeddings=96)
    from transformers import AutoTokenizer

    im_end = AutoTokenizer.from_pretrained(str(path)).convert_tokens_to_ids("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, EOS_ID], "do_sample": False}))
    with open_engine(path, speculation="off") as engine:
        yield engine, path, im_end


@pytest.fixture(scope="module")
def speculating(qwen_like):
    """The same checkpoint under a fixed suffix draft of 6 and async scheduling (tokens run past a stop)."""
    _, path, _ = qwen_like
    with open_engine(path, speculation=SPECULATION, async_scheduling=True) as engine:
        yield engine


# --- the chat layer: a reply the model ended at its other end of sequence ----------------------

def test_a_reply_ended_at_the_models_other_eos_leaves_its_logprob_out_as_its_text(qwen_like):
    """Ended at <|im_end|>, a reply's logprobs left that token out (its text is no content); ended at
    the model's other EOS, <|endoftext|>, which the template does not write, they gave it as a last
    entry "<|endoftext|>" whole and streamed, beside content that does not hold it."""
    engine, _, im_end = qwen_like
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": "hello"}]
    reply = tokenizer.encode("hi there", add_special_tokens=False)
    want = [tokenizer.decode([t]) for t in reply]
    for end in (im_end, EOS_ID):
        chat = Chat(engine, f"logprobs-{end}")
        params = SamplingParams(max_tokens=len(reply) + 1, logprobs=True)
        force_outputs(chat.handle, reply + [end])
        result = chat.respond(messages, params=params)
        assert (result.text, result.finish_reason) == ("hi there", "stop")
        assert result.usage.completion_tokens == len(reply) + 1
        assert [e["token"] for e in chat.openai_logprobs(result)] == want, end
        force_outputs(chat.handle, reply + [end])
        streamed, entries = StreamedLogprobs(chat), []
        for delta in chat.stream_respond(messages, params=params):
            streamed.add(delta)
            entries += streamed.take(delta.result) or []
        assert [e["token"] for e in entries] == want, end


def test_ignore_eos_keeps_every_end_of_sequence_out_of_the_content(qwen_like):
    """ignore_eos: the turn runs past the model's ends of sequence, which are no content (as vLLM's
    text holds no special token). <|im_end|> was left out; <|endoftext|> stood in the text."""
    engine, _, im_end = qwen_like
    tokenizer = engine.tokenizer
    reply = tokenizer.encode("hi", add_special_tokens=False)
    for end in (im_end, EOS_ID):
        chat = Chat(engine, f"ignore-{end}")
        force_outputs(chat.handle, reply + [end] + reply)
        result = chat.respond([{"role": "user", "content": "hello"}],
                              params=SamplingParams(max_tokens=2 * len(reply) + 1, ignore_eos=True))
        assert (result.text, result.finish_reason) == ("hihi", "length"), end
        assert result.raw_text == "hi" + tokenizer.decode([end]) + "hi"


# --- defaults: what generation_config.json gives ----------------------------------------------

def _with_generation_config(source, path, generation: dict):
    shutil.copytree(source, path)
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_generation_config_options_generate_applies_to_greedy_output_are_named_at_load(qwen_like, tmp_path):
    """Qwen2.5's generation config sets repetition_penalty (1.05; 1.3 here), which `generate`
    applies to greedy output too: a request applies only its own options, so greedy output is
    generate's without it, and loading said nothing of it. Its sampling defaults (temperature, top_p,
    top_k) are not taken either: greedy unless asked, as the README says."""
    _, source, im_end = qwen_like
    prompt = random_tokens(random.Random(3), 20)
    path = _with_generation_config(source, tmp_path / "rp", {
        "eos_token_id": [im_end, EOS_ID], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.3})
    generated = hf_generate(path, prompt, 16)
    plain = hf_greedy(source, prompt, 16)
    assert generated != plain  # the case is what it says: the penalty changes generate's greedy output
    with pytest.warns(UserWarning, match=r"generation_config\.json sets repetition_penalty=1\.3, which "
                                         r"transformers' generate applies to greedy output too.*"
                                         r"SamplingParams\(repetition_penalty=1\.3\)"):
        engine = open_engine(path, speculation="off")
    with engine:
        state = engine.open_state("a")
        assert list(state.generate(SamplingParams(max_tokens=16, ignore_eos=True), prompt=prompt).token_ids) == plain
        penalized = state.generate(SamplingParams(max_tokens=16, repetition_penalty=1.3), prompt=prompt)
        assert list(penalized.token_ids) == generated
    # sampling defaults alone, and the neutral values, say nothing
    quiet = _with_generation_config(source, tmp_path / "quiet", {
        "eos_token_id": [im_end, EOS_ID], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_engine(quiet, speculation="off").close()


def test_generation_config_min_new_tokens_is_named_too(qwen_like, tmp_path):
    """`generate` holds EOS off for min_new_tokens (vLLM's min_tokens); requests do not."""
    _, source, im_end = qwen_like
    path = _with_generation_config(source, tmp_path / "min", {"eos_token_id": [im_end, EOS_ID],
                                                              "min_new_tokens": 3, "no_repeat_ngram_size": 2})
    with pytest.warns(UserWarning, match=r"sets no_repeat_ngram_size=2, min_new_tokens=3, which"):
        open_engine(path, speculation="off").close()


def test_an_in_memory_models_generation_config_is_read_alike(qwen_like):
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine

    _, source, _ = qwen_like
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    model.generation_config.repetition_penalty = 1.05
    with pytest.warns(UserWarning, match=r"Qwen2ForCausalLM's generation config sets repetition_penalty=1\.05"):
        Engine.from_hf_model(model, device="cpu", dtype="float32", num_blocks=16, progress=False).close()


# --- ends of sequence from every source, and the limits ---------------------------------------

def test_a_list_of_three_eos_stops_at_whichever_comes_first_as_generate_does(qwen_like, tmp_path):
    """Llama 3.1's generation config names three ends; the engine stops where `generate` does, runs
    past all of them under ignore_eos, and still stops at a stop_token_ids token there."""
    _, source, _ = qwen_like
    prompt = random_tokens(random.Random(11), 20)
    tokens = hf_greedy(source, prompt, 24)
    firsts = [t for i, t in enumerate(tokens) if t not in tokens[:i] and t != EOS_ID]
    a, b, c = firsts[3], firsts[6], firsts[1]
    path = _with_generation_config(source, tmp_path / "three", {"eos_token_id": [a, b, c]})
    want = hf_generate(path, prompt, 24)
    assert want == tokens[:tokens.index(c) + 1]
    with open_engine(path, speculation=SPECULATION) as engine:
        assert engine.eos_token_ids == {a, b, c}
        got = engine.open_state("a").generate(SamplingParams(max_tokens=24), prompt=prompt)
        assert (list(got.token_ids), got.finish_reason) == (want, "stop")
        past = engine.open_state("b").generate(SamplingParams(max_tokens=24, ignore_eos=True), prompt=prompt)
        assert (list(past.token_ids), past.finish_reason) == (tokens, "length")
        told = engine.open_state("c").generate(SamplingParams(max_tokens=24, ignore_eos=True,
                                                              stop_token_ids=[b]), prompt=prompt)
        assert (list(told.token_ids), told.finish_reason) == (tokens[:tokens.index(b) + 1], "stop")


def test_the_context_end_is_length_and_a_full_context_is_refused(qwen_like):
    """max_tokens reaching the context's end exactly, or past it, ends there as "length"; a history
    that fills the context is refused, the state unchanged."""
    engine, path, _ = qwen_like
    context = engine.max_model_len
    prompt = random_tokens(random.Random(5), context - 8)
    for max_tokens in (8, 9, 500):  # exactly to the end, one past it, far past it
        state = engine.open_state(f"end-{max_tokens}")
        c = state.generate(SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt=prompt)
        assert (len(c.token_ids), c.finish_reason, len(state)) == (8, "length", context)
        assert_greedy_matches(path, prompt, c.token_ids)
    full = engine.open_state("full")
    full.sync(random_tokens(random.Random(6), context))
    before = full.tokens
    with pytest.raises(ContextLengthError, match="no room to generate"):
        full.generate(SamplingParams(max_tokens=1))
    assert full.tokens == before


# --- stop strings -------------------------------------------------------------------------------

def _reference(engine, prompt: list[int], max_tokens: int):
    """Greedy text and tokens with no stop, and the text's length after each token."""
    events = list(engine.open_state(f"ref-{len(engine.states())}").stream(
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculation="off"), prompt=prompt))
    ends, at = [], 0
    for event in events[:-1]:
        at += len(event.text)
        ends.append(at)
    return events[-1].completion, ends


def _expected(text: str, stops: list[str]) -> tuple[int, str]:
    """Where the text ends, and the stop string that ended it: the one whose end comes first (of two
    ending there, the longer, which began first)."""
    end, stop = min((text.find(s) + len(s), -len(s), s) for s in stops if s in text)[::2]
    return end, stop


@pytest.mark.parametrize("which", ["plain", "speculating"])
def test_stop_strings_end_the_text_where_the_first_completes(qwen_like, speculating, which):
    """Stop strings spanning tokens, overlapping, one a prefix of another: the text ends before the
    first to complete, the tokens at the one that completed it (the state holds exactly them), no
    streamed delta shows what is cut, and the next turn is `generate`'s on the whole history."""
    engine, path, _ = qwen_like
    engine = engine if which == "plain" else speculating
    rng = random.Random(17)
    for case in range(4):
        prompt = random_tokens(rng, 20)
        ref, ends = _reference(engine, prompt, 32)
        text = ref.text
        for _ in range(5):
            stops = []
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(text) - 1)
                stops.append(text[at:at + rng.randint(2, 6)])
            stops.append(stops[0][:-1] or stops[0])  # a prefix of another
            stops = list(dict.fromkeys(stops))
            end, stop = _expected(text, stops)
            kept = next(i for i, e in enumerate(ends) if e >= end) + 1
            state = engine.open_state(f"{which}-{case}-{len(engine.states())}")
            events = list(state.stream(SamplingParams(max_tokens=32, ignore_eos=True, stop=stops), prompt=prompt))
            c, shown = events[-1].completion, ""
            for event in events:
                shown += event.text
                assert c.text.startswith(shown), (stops, shown, c.text)
            assert (c.text, c.stop_string, c.finish_reason) == (text[:end - len(stop)], stop, "stop"), stops
            assert list(c.token_ids) == list(ref.token_ids[:kept]) and shown == c.text
            assert state.tokens == prompt + list(c.token_ids)
        state.append([7, 8, 9])
        history = state.tokens
        assert_greedy_matches(path, history, state.generate(SamplingParams(max_tokens=8, ignore_eos=True)).token_ids)


def test_a_stop_string_is_not_matched_across_the_prompts_end(qwen_like):
    """As vLLM's: the prompt's last characters and the first generated ones make no stop string."""
    engine, _, _ = qwen_like
    prompt = random_tokens(random.Random(23), 20)
    ref, _ = _reference(engine, prompt, 12)
    tail = engine.tokenizer.decode(prompt[-2:])
    stop = tail[-2:] + ref.text[:2]
    c = engine.open_state("across").generate(SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]),
                                             prompt=prompt)
    assert stop not in ref.text and (c.text, c.finish_reason) == (ref.text, "length")


SENTENCEPIECE_PIECES = ["▁", *"abcdefgh", "▁a"]


def _byte_fallback_tokenizer():
    """Llama 2's layout: <unk> <s> </s>, the 256 byte tokens, a few pieces (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                                         *SENTENCEPIECE_PIECES])}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_unicode_stop_strings_split_across_byte_fallback_tokens(tmp_path):
    """Characters of 2, 3 and 4 bytes, one byte token each: a stop string ends the text before it
    however its characters' bytes fall, and no delta shows a byte of it."""
    tokenizer = _byte_fallback_tokenizer()
    path = make_tiny_checkpoint("llama", tmp_path / "sp", vocab_size=len(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(path)

    def spelt(text: str) -> list[int]:  # a byte token each
        return [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]

    out = ([tokenizer.convert_tokens_to_ids("▁a"), tokenizer.convert_tokens_to_ids("b")] + spelt("é")
           + [tokenizer.convert_tokens_to_ids("c")] + spelt("😀") + [tokenizer.convert_tokens_to_ids("d")]
           + spelt("日本") + [tokenizer.convert_tokens_to_ids("e")])
    whole = " abéc😀d日本e"
    cases = {"é": " ab", "bé": " a", "c😀d": " abé", "😀": " abéc", "本": " abéc😀d日", "日本e": " abéc😀d",
             "本x": whole, "ab": " "}
    with open_engine(path, speculation="off") as engine:
        prompt = tokenizer.encode("abc", add_special_tokens=False)
        for i, (stop, want) in enumerate(cases.items()):
            state = engine.open_state(f"u{i}")
            force_outputs(state, out)
            events = list(state.stream(SamplingParams(max_tokens=len(out), ignore_eos=True, stop=[stop]),
                                       prompt=prompt))
            c = events[-1].completion
            assert c.text == want and "".join(e.text for e in events) == want, stop
            assert c.stop_string == (None if want == whole else stop)


def test_a_chat_turn_cut_by_a_stop_string_then_the_next_turn(qwen_like, speculating):
    """The reply ends before its stop string (streamed alike), the next turn's prompt is the rendered
    history's tokens, and its reply is `generate`'s on them."""
    engine, path, _ = qwen_like
    tokenizer = engine.tokenizer
    rng = random.Random(29)
    for turn_engine in (engine, speculating):
        messages = [{"role": "user", "content": "read the file today and write it"}]
        probe = Chat(turn_engine, f"probe-{id(turn_engine)}").respond(
            messages, params=SamplingParams(max_tokens=24, ignore_eos=True))
        at = rng.randrange(2, len(probe.text) - 3)
        stop = probe.text[at:at + 3]
        chat = Chat(turn_engine, f"stop-{id(turn_engine)}")
        deltas = list(chat.stream_respond(messages, params=SamplingParams(max_tokens=24, ignore_eos=True,
                                                                          stop=[stop])))
        result = deltas[-1].result
        assert (result.text, result.stop_sequence, result.finish_reason) == (
            probe.text[:probe.text.find(stop)], stop, "stop")
        assert "".join(d.text for d in deltas) == result.text
        messages += [assistant_message(result), {"role": "user", "content": "and then?"}]
        prompt = chat.prompt_ids(messages)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(prompt) == rendered
        chat.respond(messages, params=SamplingParams(max_tokens=10, ignore_eos=True))
        held = chat.handle.tokens
        assert held[:len(prompt)] == prompt
        assert_greedy_matches(path, prompt, held[len(prompt):])
