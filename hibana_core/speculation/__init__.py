"""Adaptive speculation: drafters propose, the ordinary batched step verifies, a controller picks
how many tokens each agent drafts from measured acceptance and step cost.

    drafters.py    the Drafter protocol (a proposal: token ids, or a SampledDraft with the distribution
                   they were drawn from); suffix (default) and ngram drafters (registered as plugins)
    draft_model.py the draft-model drafter: a smaller checkpoint with the target's tokenizer
    index.py       context indexes over token streams, updated per token
    controller.py  acceptance statistics, the step-cost model, the per-step plan
    speculator.py  the scheduler's speculation policy that ties them together
"""

from __future__ import annotations

from typing import Sequence

from hibana_core.speculation.drafters import Drafter, DraftInput, NgramDrafter, SampledDraft, SuffixDrafter


def force_outputs(handle, token_ids: Sequence[int]) -> None:
    """Bench only: the state's next generation emits exactly `token_ids` (trace replay). The
    model still runs every forward and drafts are verified against these tokens, so a model
    with random weights runs the step shapes and acceptance of the model that produced them.
    Generate with `max_tokens=len(token_ids)` and `ignore_eos=True`."""
    handle._registry.force_outputs(handle, token_ids)


__all__ = ["Drafter", "DraftInput", "NgramDrafter", "SampledDraft", "SuffixDrafter", "force_outputs"]
