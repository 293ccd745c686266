"""Mistral's think markers, tried as a new user would: the next turn's reuse of a reply that thought."""

from __future__ import annotations

from hibana_core import SamplingParams
from hibana_core.chat import Chat, assistant_message
from hibana_core.speculation import force_outputs
from magistral_model import SPECIAL


def test_generated_reasoning_history_keeps_the_thinking_of_a_mistral_reply(magistral):
    """reasoning_history="generated" keeps the state's own thinking where the template leaves it
    out (Magistral's drops a reply's reasoning_content): the next user turn computes only its own
    tokens. For Mistral's templates it recomputed from the reply on: the template writes no
    generation prompt (a reply follows [/INST] or [/TOOL_RESULTS]), so no think block was known as
    a reply's, and the reply's end (</s>, the engine's EOS) was no end of a held reply."""
    tokenizer = magistral.tokenizer
    ids = [t for piece in ["[THINK]", "I think.", "[/THINK]", "Hello there."]
           for t in tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=piece not in SPECIAL)]
    ids += sorted(magistral.eos_token_ids)
    hello = [{"role": "user", "content": "Hi"}]
    for policy in ("template", "generated"):
        chat = Chat(magistral, f"history-{policy}")
        force_outputs(chat.handle, ids)
        first = chat.respond(hello, None, SamplingParams(max_tokens=len(ids)), reasoning_history=policy)
        assert (first.reasoning, first.text) == ("I think.", "Hello there.")
        held = first.usage.prompt_tokens + first.usage.completion_tokens
        history = hello + [assistant_message(first), {"role": "user", "content": "again"}]
        second = chat.respond(history, None, SamplingParams(max_tokens=1), reasoning_history=policy)
        if policy == "generated":  # all but the reply's last token, which no forward has seen yet
            assert second.usage.cached_tokens == held - 1 and second.usage.prompt_tokens > held
        else:  # the template's history: recomputed from the reply, whose thinking it left out
            assert second.usage.cached_tokens == first.usage.prompt_tokens
