"""The server's streamed log-probabilities (`openai_api.Reply`): each chunk carries those of the
tokens that arrived since the last chunk that carried any, per choice; an end-of-turn token
waits, so the join of a stream's chunks is the whole reply's `logprobs.content` whatever the
chunking. No model: a chat stand-in writes a token as its id."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from hibana_core.chat import Chat  # noqa: E402
from hibana_core.state import TokenLogprob  # noqa: E402
from hibana_core.turn import ChatDelta, ChatResult, Usage  # noqa: E402
from hibana_plugins.openai_api import Reply  # noqa: E402

END = 99


class FakeChat:
    stop_token_ids = (END,)
    closing_token_ids = frozenset(stop_token_ids)
    openai_logprobs = Chat.openai_logprobs  # the chat layer's own: the end token left out of a result's

    def openai_token_logprobs(self, logprobs):
        return [{"token": str(lp.token_id), "logprob": lp.logprob} for lp in logprobs]


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -token / 100)


def tokens_of(chunks: list[dict], index: int = 0) -> list[str]:
    return [e["token"] for c in chunks for choice in c["choices"] if choice["index"] == index
            for e in (choice["logprobs"] or {}).get("content", [])]


def result(ids: list[int], finish: str = "stop") -> ChatResult:
    return ChatResult("", [], finish, Usage(1, 0, len(ids)), logprobs=[lp(t) for t in ids])


def test_each_chunk_carries_its_tokens_and_the_end_token_is_left_out():
    reply = Reply("m", FakeChat())
    # tokens 1, 2 made a delta; 3 made none (held back), 4 with it; the end token's step made a last flush
    stream = [[ChatDelta(text="a", logprobs=(lp(1), lp(2)))],
              [ChatDelta(text="b", logprobs=(lp(3), lp(4))), ChatDelta(text="c")],
              [ChatDelta(text="d", logprobs=(lp(5), lp(END)))],
              [ChatDelta(result=result([1, 2, 3, 4, 5, END]))]]
    chunks = [c for batch in stream for c in reply.chunks(batch)]
    assert tokens_of(chunks) == ["1", "2", "3", "4", "5"]
    carried = [c["choices"][0]["logprobs"] is not None for c in chunks]
    assert carried == [True, True, True, False]  # "b" and "c" were joined into one chunk with both deltas' tokens


def test_an_end_token_passed_mid_reply_is_given_with_the_next_chunk():
    reply = Reply("m", FakeChat())
    chunks = reply.chunks([ChatDelta(text="a", logprobs=(lp(1), lp(END)))])
    chunks += reply.chunks([ChatDelta(text="b", logprobs=(lp(2),))])
    chunks += reply.chunks([ChatDelta(result=result([1, END, 2], "length"))])
    assert tokens_of(chunks) == ["1", str(END), "2"]


def test_tokens_no_chunk_carried_come_with_the_result_and_choices_count_apart():
    reply = Reply("m", FakeChat(), n=2)
    chunks = reply.chunks([ChatDelta(text="x", logprobs=(lp(7),))], index=1)
    chunks += reply.chunks([ChatDelta(text="y", logprobs=(lp(1),))], index=0)
    chunks += reply.chunks([ChatDelta(result=result([1, 2, 3]))], index=0)     # 2 and 3 made no delta
    chunks += reply.chunks([ChatDelta(text="z", cut_call=True, logprobs=(lp(8),)),  # dropped: cut by length
                            ChatDelta(result=result([7, 8], "length"))], index=1)
    assert tokens_of(chunks, 0) == ["1", "2", "3"]
    assert tokens_of(chunks, 1) == ["7", "8"]


def test_a_reply_without_logprobs_has_none_on_any_chunk():
    reply = Reply("m", FakeChat())
    chunks = reply.chunks([ChatDelta(text="a"), ChatDelta(result=ChatResult("a", [], "stop", Usage(1, 0, 1)))])
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
