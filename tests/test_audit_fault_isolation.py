"""Outside audit of fault isolation: something inside a step or a turn fails for one agent while
others run. Only that agent's request fails, with a HibanaError saying what to do; the others get
their solo greedy output, and the engine serves the next request.
"""

from __future__ import annotations

import random
import threading

import pytest

from hibana_core import SamplingParams
from hibana_core import detokenizer
from hibana_core.errors import CheckpointError
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(120)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, ignore_eos=True, **kw)


def run_agents(engine, calls: dict, join_all) -> dict:
    """calls: name -> (history, params, read) run at once on threads named by the agents; name ->
    token ids, or the exception raised."""
    results: dict = {}
    ready = threading.Barrier(len(calls))

    def run(name, history, params, read) -> None:
        handle = engine.open_state(name)
        handle.sync(history)
        ready.wait()
        try:
            results[name] = read(handle, params)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name, *call), name=name, daemon=True)
               for name, call in calls.items()]
    for t in threads:
        t.start()
    join_all(threads, 60)
    return results


def generate(handle, params):
    return handle.generate(params).token_ids


def stream(handle, params):
    return [ev.token_id for ev in handle.stream(params) if ev.token_id is not None]


@pytest.mark.parametrize("read", [generate, stream])
def test_a_token_the_tokenizer_cannot_decode_fails_its_request_alone(tiny_checkpoints, make_engine, join_all,
                                                                     monkeypatch, read):
    """A slow (sentencepiece) tokenizer raises IndexError for an id past its pieces, which a model
    with a padded vocabulary can sample. For a request with stop strings the text is decoded on the
    engine thread: the error left the step and failed every agent's request ("engine step failed");
    without stop strings the reader got the bare IndexError."""
    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    histories = {name: random_tokens(random.Random(seed), 20) for seed, name in enumerate(("a", "culprit", "c"))}
    solo = {name: engine.open_state("solo-" + name).generate(greedy(stop=["\x00\x01"]), prompt=h).token_ids
            for name, h in histories.items()}
    others = {t for name in ("a", "c") for t in solo[name] + histories[name]}
    odd = next(t for t in solo["culprit"][2:] if t not in others and t not in histories["culprit"])
    made = detokenizer.text_decoder

    def text_decoder(tokenizer):
        decode = made(tokenizer)

        def checked(ids):
            if odd in ids:
                raise IndexError("piece id is out of range.")
            return decode(ids)
        return checked

    monkeypatch.setattr(detokenizer, "text_decoder", text_decoder)
    stops = greedy(stop=["\x00\x01"])  # a and c decode on the engine thread too
    culprit = greedy(stop=["\x00\x01"]) if read is generate else greedy()
    got = run_agents(engine, {"a": (histories["a"], stops, generate),
                              "culprit": (histories["culprit"], culprit, read),
                              "c": (histories["c"], stops, generate)}, join_all)
    assert got["a"] == solo["a"] and got["c"] == solo["c"]
    error = got["culprit"]
    assert isinstance(error, CheckpointError), repr(error)
    assert f"token {odd}" in str(error) and "logit_bias" in str(error)
    # it keeps the tokens it generated up to the one it could not decode (README: a generation
    # that fails partway keeps what it generated)
    kept = engine.open_state("culprit").tokens
    assert kept[:20] == histories["culprit"] and kept[20:] == solo["culprit"][:len(kept) - 20]
    assert engine.open_state("later").generate(greedy(stop=["\x00\x01"]), prompt=histories["a"]).token_ids == solo["a"]


def test_a_history_the_tokenizer_cannot_decode_is_refused_with_a_hibana_error(tiny_checkpoints, make_engine,
                                                                              monkeypatch):
    """The text after a history is decoded from its last tokens when a request is submitted; a
    tokenizer raising on one of them gave the caller its bare IndexError. It is a CheckpointError,
    the state holds its history, and the next request runs."""
    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    history = random_tokens(random.Random(7), 20)
    want = engine.open_state("ref").generate(greedy(), prompt=history).token_ids
    handle = engine.open_state("culprit")
    handle.sync(history)
    decode = engine.tokenizer.decode

    def checked(ids, **kw):
        if history[-1] in ids:
            raise IndexError("piece id is out of range.")
        return decode(ids, **kw)

    monkeypatch.setattr(engine.tokenizer, "decode", checked)
    with pytest.raises(CheckpointError, match="failed to decode the end of the state's history"):
        handle.generate(greedy(stop=["\x00\x01"]))
    assert handle.tokens == history
    monkeypatch.undo()
    assert handle.generate(greedy()).token_ids == want


def test_a_delivery_that_fails_fails_its_request_alone(tiny_checkpoints, make_engine, join_all, monkeypatch):
    """Handing one request's tokens to its stream raised (a tokenizer's, a stream's fault): the
    error left the step, and every request in the engine failed ("engine step failed"). Now that
    request fails alone with a HibanaError, keeping the tokens it generated; the others get their
    solo output and the engine serves the next request."""
    from hibana_core.errors import HibanaError

    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    histories = {name: random_tokens(random.Random(seed), 20) for seed, name in enumerate(("a", "culprit", "c"))}
    solo = {name: engine.open_state("solo-" + name).generate(greedy(), prompt=h).token_ids
            for name, h in histories.items()}
    made, take = detokenizer.Detokenizer.__init__, detokenizer.Detokenizer.take_delta

    def init(self, tokenizer, history, *args, **kwargs):
        made(self, tokenizer, history, *args, **kwargs)
        self.culprit = list(history)[:20] == histories["culprit"]

    def take_delta(self, final=False):  # the culprit's text (stop strings: decoded on the engine thread)
        if getattr(self, "culprit", False) and len(self.text) > 3:
            raise RuntimeError("the stream's queue is gone")
        return take(self, final)

    monkeypatch.setattr(detokenizer.Detokenizer, "__init__", init)
    monkeypatch.setattr(detokenizer.Detokenizer, "take_delta", take_delta)
    got = run_agents(engine, {"a": (histories["a"], greedy(), stream),
                              "culprit": (histories["culprit"], greedy(stop=["\x00\x01"]), stream),
                              "c": (histories["c"], greedy(), generate)}, join_all)
    assert got["a"] == solo["a"] and got["c"] == solo["c"]
    error = got["culprit"]
    assert isinstance(error, HibanaError) and "the stream's queue is gone" in str(error), repr(error)
    kept = engine.open_state("culprit").tokens
    assert kept[:20] == histories["culprit"] and kept[20:] == solo["culprit"][:len(kept) - 20]
    assert engine.open_state("later").generate(greedy(), prompt=histories["a"]).token_ids == solo["a"]


@pytest.mark.parametrize("stops", [["\x00\x01"], []], ids=["engine-thread", "reader-side"])
def test_a_final_text_that_cannot_be_decoded_fails_its_request_with_a_hibana_error(tiny_checkpoints, make_engine,
                                                                                 join_all, monkeypatch, stops):
    """The end of a request's text (what was held back) fails to decode: the request fails with a
    HibanaError, on the engine's thread (stop strings) and where the reader decodes (none), and its
    reader is not left waiting; the others get their solo output."""
    from hibana_core.errors import HibanaError

    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    histories = {name: random_tokens(random.Random(seed), 20) for seed, name in enumerate(("a", "culprit"))}
    solo = engine.open_state("solo-a").generate(greedy(), prompt=histories["a"]).token_ids
    made, take = detokenizer.Detokenizer.__init__, detokenizer.Detokenizer.take_delta

    def init(self, tokenizer, history, *args, **kwargs):
        made(self, tokenizer, history, *args, **kwargs)
        self.culprit = list(history)[:20] == histories["culprit"]

    def take_delta(self, final=False):
        if final and getattr(self, "culprit", False):
            raise RuntimeError("the held-back text broke")
        return take(self, final)

    monkeypatch.setattr(detokenizer.Detokenizer, "__init__", init)
    monkeypatch.setattr(detokenizer.Detokenizer, "take_delta", take_delta)
    got = run_agents(engine, {"a": (histories["a"], greedy(), generate),
                              "culprit": (histories["culprit"], greedy(stop=stops), stream)}, join_all)
    assert got["a"] == solo
    assert isinstance(got["culprit"], HibanaError) and "held-back text broke" in str(got["culprit"])
