"""What a process that serves agents for days meets: states that calls name (an adapter's
`state_id`, LangGraph's `thread_id`, a server client's name) come and go by the thousand, and
what the engine keeps for them must stay bounded."""

from __future__ import annotations

import random

import pytest

from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(120)


def _call(engine, state_id: str, seed: int) -> None:
    """One call on the state `state_id` names, as the adapters make it (`Engine.lease`)."""
    prompt = random_tokens(random.Random(seed), 12)
    with engine.lease(state_id=state_id) as h:
        h.sync(prompt)


def test_states_that_named_calls_open_are_bounded(tiny_checkpoints, make_engine):
    """A LangGraph app gives each conversation a thread id, which names its state: a new one per
    conversation, never closed by the adapter. They piled up without bound (tokens, index and
    KV bookkeeping of every conversation since the start); past max_named_states the least
    recently used idle ones are closed, never one a call holds, nor a state of open_state."""
    engine = make_engine(tiny_checkpoints["llama"], max_named_states=3, speculation="off")
    own = engine.open_state("own")
    own.sync([1, 2, 3])
    with engine.lease(state_id="held") as held:
        held.sync([4, 5, 6])
        for i in range(12):
            _call(engine, f"thread-{i}", i)
        # the held one is the least recently used, yet in use: kept (and counted), the newest two beside it
        assert {s.id for s in engine.states()} == {"own", "held", "thread-10", "thread-11"}
    # once its call ends it is the most recently used
    assert {s.id for s in engine.states()} == {"own", "held", "thread-10", "thread-11"}
    _call(engine, "thread-10", 10)  # used again: now the most recent
    _call(engine, "thread-12", 12)
    assert {s.id for s in engine.states()} == {"own", "held", "thread-10", "thread-12"}
    assert own.tokens == [1, 2, 3]
    _call(engine, "own", 0)  # a state of open_state leased by its id is still never counted
    assert "own" in {s.id for s in engine.states()}
    assert engine.stats().kv_blocks_used <= 5  # a block each: the closed states' KV went with them


def test_named_states_put_away_come_back_from_state_dir(tiny_checkpoints, make_engine, tmp_path):
    """With a state_dir, a state past the bound is written there before it is closed (as a
    server's --max-named-states puts its states away): its id, named again, brings its history
    back; the folder holds one file per state put away, no more."""
    engine = make_engine(tiny_checkpoints["llama"], max_named_states=2, state_dir=tmp_path, speculation="off")
    for i in range(6):
        _call(engine, f"thread-{i}", i)
    assert {s.id for s in engine.states()} == {"thread-4", "thread-5"}
    assert len(list(tmp_path.glob("*.state"))) == 4
    with engine.lease(state_id="thread-0") as h:
        assert h.tokens == random_tokens(random.Random(0), 12)
    assert len(engine.states()) == 2


def test_a_bound_of_zero_keeps_no_named_state_between_calls(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], max_named_states=0, speculation="off")
    for i in range(3):
        _call(engine, f"thread-{i}", i)
    assert engine.states() == []
    assert engine.stats().kv_blocks_used == 0


def test_the_bound_is_checked():
    from hibana_core import ConfigError
    from hibana_core.config import EngineConfig

    assert EngineConfig.from_overrides("demo").cache.max_named_states == 4096
    with pytest.raises(ConfigError, match="max_named_states must be >= 0"):
        EngineConfig.from_overrides("demo", max_named_states=-1)


def test_hibana_serve_gives_the_engine_its_own_bound():
    """`hibana serve --max-named-states N` bounds its clients' states at N; the engine's own bound
    (4096 by default) would have closed them sooner past 4096: the server passes N on."""
    from hibana_core.config import EngineConfig
    from hibana_plugins import server

    options = server.engine_options(server.build_parser().parse_args(["demo", "--max-named-states", "10000"]))
    assert EngineConfig.from_overrides("demo", **options).cache.max_named_states == 10000


def test_a_chat_layer_remembers_a_bounded_number_of_unknown_roles(make_engine):
    """A server has one chat layer for its life; each request whose message had a role the
    template does not know (refused, a ConversationError) left that role, of any length, in the
    layer's memory for good: distinct roles from clients grew it without bound."""
    from hibana_core import ConversationError
    from hibana_core.chat import Chat

    chat = Chat(make_engine("demo", speculation="off"))
    for i in range(200):
        role = f"role-{i}" + "x" * (i % 3) * 100
        try:
            chat.render_text([{"role": "user", "content": "hi"}, {"role": role, "content": "hi"}])
        except ConversationError:
            pass
    assert 0 < len(chat._roles) <= 64  # chat.ROLES_CACHED
    assert chat.render_text([{"role": "user", "content": "hi"}])  # the layer still serves
