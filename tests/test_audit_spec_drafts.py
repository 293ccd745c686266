"""Outside audit of speculation (issue 13): what a plugin's `SampledDraft` may hand the engine.

A drafter that draws its drafts from a distribution q of its own returns them with q; the target
keeps each with probability min(1, p/q) and draws from max(0, p - q) at the first it rejects, which
is exact only where q is the distribution the drafts were drawn from, as a distribution: a q left
unnormalised (weights, counts), with NaN where the drafter had nothing to say, or with no mass on
the very token drawn, skewed the output (the draft was then kept whatever p said), and a q on
another device than the engine's failed the step, and so the request. Drafts change speed only.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.sampler import DraftRow, Sampler, SamplingRow
from hibana_core.speculation import SampledDraft
from hibana_core.speculation.speculator import valid_draft
from hibana_plugins.manager import PluginWarning
from spec_drafters import registered
from tiny_models import open_engine

pytestmark = pytest.mark.timeout(120)

V = 7
P = torch.tensor([0.42, 0.21, 0.13, 0.1, 0.07, 0.05, 0.02])   # the target's distribution
Q = torch.tensor([0.05, 0.45, 0.1, 0.1, 0.1, 0.1, 0.1])       # the drafter's: it draws from this
DRAWS = 40_000


def verified_distribution(reported: torch.Tensor) -> np.ndarray:
    """DRAWS drafts drawn from Q, each verified by the sampler at p = P against `reported` (what
    the drafter says q is, passed through `valid_draft` as the engine does): the distribution of
    the tokens the target keeps."""
    drafts = torch.multinomial(Q, DRAWS, replacement=True, generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=1.0)
    rows = []
    for x in range(V):  # one valid_draft per distinct draft: its q as the engine takes it
        checked = valid_draft(SampledDraft([x], reported[None]), 1, V, sampled=True)
        rows.append(SamplingRow(params, None, (), (), 0, DraftRow(x, checked.probs[0], checked.drawn, 0)))
    sampler = Sampler(torch.device("cpu"), seed=5)
    tokens = sampler(P.log()[None].expand(DRAWS, V).contiguous(), [rows[x] for x in drafts])
    return np.bincount(tokens.numpy(), minlength=V) / DRAWS


@pytest.mark.parametrize("what", ["as drawn", "unnormalised", "NaN elsewhere", "no mass on a drawn token"])
def test_drawn_drafts_keep_the_target_distribution_whatever_q_the_drafter_reports(what):
    reported = {
        "as drawn": Q,
        "unnormalised": 3.0 * Q,  # weights, not probabilities: kept at min(1, p / 3q) before
        "NaN elsewhere": torch.where(torch.arange(V) == 6, float("nan"), Q),
        "no mass on a drawn token": torch.where(torch.arange(V) == 6, 0.0, Q),  # token 6 was kept always
    }[what]
    got = verified_distribution(reported)
    tv = 0.5 * np.abs(got - P.numpy()).sum()
    assert tv < 0.015, f"{what}: total variation {tv:.3f} from the target's distribution: {got.round(3)}"


def test_sampled_draft_probs_are_checked_without_changing_a_sound_q():
    q = torch.rand(3, 10).softmax(dim=-1)
    kept = valid_draft(SampledDraft([4, 1, 8], q), 3, 10, sampled=True)
    assert kept.drawn and kept.tokens == [4, 1, 8]
    assert kept.probs.dtype == torch.float32 and torch.allclose(kept.probs, q, atol=1e-6)
    half = valid_draft(SampledDraft([4, 1], q.double()), 3, 10, sampled=True)  # float64: read as float32
    assert half.probs.dtype == torch.float32 and torch.allclose(half.probs, q[:2], atol=1e-6)
    empty = torch.zeros(2, 10)  # no mass anywhere: the drafts are verified as chosen ones (the token alone)
    assert torch.equal(valid_draft(SampledDraft([3, 5], empty), 2, 10, sampled=True).probs,
                       torch.eye(10)[[3, 5]])


class OnOtherDevice:
    """Draws nothing in particular, and hands q on a device that is not the engine's (here `meta`,
    which no tensor leaves: as CPU-side q under a CUDA engine, had the drafter no way to move it)."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, state, k: int):
        self.calls += 1
        return SampledDraft([3] * k, torch.empty(k, 32, device="meta"))


def test_a_sampled_draft_on_another_device_costs_speed_only(tiny_checkpoints):
    drafter = OnOtherDevice()
    with registered(elsewhere=drafter):
        engine = open_engine(tiny_checkpoints["qwen3"], speculation="off")
    try:
        params = SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True,
                                speculation={"method": "elsewhere", "k": 2})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = engine.open_state("a").generate(params, prompt=[11, 12, 13])
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert drafter.calls > 0 and engine.stats().speculation["drafter_errors"] == {"elsewhere": drafter.calls}
        assert any(issubclass(w.category, PluginWarning) and "elsewhere" in str(w.message) for w in caught)
    finally:
        engine.close()
