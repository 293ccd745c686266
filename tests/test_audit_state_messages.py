"""The state-handle API's refusals say what to do (DESIGN.md, Errors), and a refused call leaves
the state and every other state as they were."""

from __future__ import annotations

import pytest

from hibana_core import Engine, InvalidTokenError, SamplingParams, StateFileError


@pytest.fixture(scope="module")
def demo_engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", num_blocks=64) as engine:
        yield engine


@pytest.mark.parametrize("text", ["hello there", b"hello there"])
def test_text_given_as_token_ids_says_to_tokenize_it(demo_engine, text):
    h = demo_engine.open_state("audit-text")
    other = demo_engine.open_state("audit-text-other")
    try:
        h.sync([5, 6, 7])
        other.sync([8, 9])
        for call in (lambda: h.sync(text), lambda: h.append(text),
                     lambda: h.generate(SamplingParams(max_tokens=2), prompt=text)):
            with pytest.raises(InvalidTokenError, match=r"tokenizer\.encode.*engine\.chat"):
                call()
        assert h.tokens == [5, 6, 7] and other.tokens == [8, 9]
        assert other.generate(SamplingParams(max_tokens=2)).finish_reason in ("length", "stop")
    finally:
        h.close()
        other.close()


def test_a_state_file_that_cannot_be_written_says_what_to_do(demo_engine, tmp_path):
    h = demo_engine.open_state("audit-save")
    try:
        h.sync([5, 6, 7])
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        # its folder cannot be made: a file stands where the folder would be
        with pytest.raises(StateFileError, match="cannot write the state file .*; save it to a path"):
            h.save(blocker / "state.safetensors")
        assert h.tokens == [5, 6, 7]
        h.save(tmp_path / "ok.safetensors")  # the state still saves where it can
    finally:
        h.close()
