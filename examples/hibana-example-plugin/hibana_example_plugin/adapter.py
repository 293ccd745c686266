"""A tiny adapter: token ids in, a Completion out, through one resident state handle."""

from __future__ import annotations


class ExampleAdapter:
    """Adapter factory and adapter in one: `ExampleAdapter(engine=engine)`.

    Like every adapter it never assumes the state already holds the prompt: it syncs first, so a
    call whose prompt extends the previous one costs only the new tokens.
    """

    def __init__(self, engine, state_id: str = "example") -> None:
        self.engine = engine
        self.state_id = state_id

    def complete(self, prompt_token_ids, max_tokens: int = 64):
        """Greedy continuation of the prompt; returns the engine's Completion. The prompt goes to
        `sync` as given: a list of ints, an array, a tensor or a tokenizer's output as it comes."""
        from hibana_core import SamplingParams  # the engine is only needed once it is used

        handle = self.engine.open_state(self.state_id)
        handle.sync(prompt_token_ids)
        return handle.generate(SamplingParams(max_tokens=max_tokens, temperature=0.0))
