"""The scheduler's speculation policy: which sequences draft how many tokens this step, and what
the verified steps teach the controller.

    schedule:  chunks that sample at the end of a fully known history -> drafter proposals (a
               constrained request's cut at the first token its grammar forbids) ->
               controller plan (k per chunk) -> the chunks grow by their drafts; a costly
               drafter (a draft model) proposes after the plan, k tokens for the chunks given
               k > 0 only, so a step planned at k=0 runs no draft forward
    update:    a verified chunk's accepted count -> its agent's AcceptanceStats; for plain decodes,
               a few "shadow" proposals per step are checked against the tokens that follow
    finish:    the request's output goes to the drafters (the shared corpus)

Drafting needs the real history, so a sequence drafts only in a step scheduled after its last
tokens reached the host. The engine core asks `wants_history` before scheduling: when some agent
would gain from drafting, the step in flight is read back first (losing one step of overlap,
which the step-cost model charges to verifying steps).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hibana_core.config import SpeculationConfig, is_kind, plain_token_ids
from hibana_core.errors import ConfigError, HibanaError
from hibana_core.speculation.controller import (MAX_DRAFT, AcceptanceStats, Candidate, Controller,
                                                StepCostModel)
from hibana_core.speculation.drafters import DraftInput, Drafter, SampledDraft, TokensView, cut, samples_drafts
from hibana_plugins.manager import PluginWarning, accepts, describe_registered

if TYPE_CHECKING:
    from hibana_core.scheduler import Request, ScheduledChunk

SHADOW_PER_STEP = 4
"""Shadow proposals per step at most (host time stays bounded at any batch size)."""


def _unless_interrupt(exc: BaseException) -> None:
    """A drafter's failure costs its drafts only, a BaseException too (an asyncio.CancelledError
    from the plugin's own event loop, a sys.exit() in its error path: either ended the engine's
    thread, and every request waited for good), but a KeyboardInterrupt on the main thread, raised
    again: a Ctrl-C while a caller steps the engine itself (`Engine.step`) stops it, as it would
    without a drafter (on another thread, where no Ctrl-C arrives, one is the plugin's own)."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise exc


def check_method(config: SpeculationConfig, registered: Sequence[str]) -> None:
    """A ConfigError, listing the registered drafters, when `config` names none of them."""
    if config.enabled and config.method not in registered:
        raise ConfigError(f"no drafter named {config.method!r} is registered (registered: "
                          f"{', '.join(sorted(registered)) or 'none'}); pass one of them as "
                          "speculation={'method': ...}, or install the plugin that provides it")


def _same_checkpoint(given: str, engine: str | None) -> bool:
    """Whether a request's draft_model names the engine's: the same text, or the same directory
    ("dir/" and "./dir" are "dir")."""
    if engine is None:
        return False
    if given == engine:
        return True
    mine, theirs = Path(given).expanduser(), Path(engine).expanduser()
    return mine.is_dir() and theirs.is_dir() and mine.resolve() == theirs.resolve()


def build_drafter(name: str, registered: Any, engine: Any) -> Drafter:
    """The drafter a plugin registered under `name`: a `factory(engine) -> drafter` (a class whose
    constructor takes the engine is one) is called; an object that already has `propose` is used
    as it is. Anything else is a ConfigError at engine build rather than a TypeError in a step."""
    expected = (f"register({name!r}, factory) with factory(engine) -> drafter, a drafter being an "
                "object with propose(state, k); or register the drafter object itself")
    if not isinstance(registered, type) and hasattr(registered, "propose"):
        return _checked_proposer(name, registered, f"is registered as {describe_registered(registered)}", expected)
    if not (callable(registered) and accepts(registered, engine)):
        raise ConfigError(f"drafter {name!r} is registered as {describe_registered(registered)}, which cannot be "
                          f"called as factory(engine); {expected}")
    try:
        drafter = registered(engine)
    except HibanaError:  # the built-ins' own (a draft model that does not load), said as they are
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's factory: its failure named, not passed through bare
        raise ConfigError(f"drafter {name!r}: its factory, {describe_registered(registered)}, failed: "
                          f"{type(exc).__name__}: {exc}; fix its plugin, or name another drafter") from exc
    if not hasattr(drafter, "propose"):
        raise ConfigError(f"drafter {name!r}: its factory, {describe_registered(registered)}, returned "
                          f"{describe_registered(drafter)}, which has no propose(state, k); {expected}")
    return _checked_proposer(name, drafter, f"(from its factory, {describe_registered(registered)}) is "
                                            f"{describe_registered(drafter)}", expected)


def _checked_proposer(name: str, drafter: Any, what: str, expected: str) -> Drafter:
    """`drafter` unless its propose cannot be called as propose(state, k): a ConfigError at engine
    build then, where every step would otherwise raise and draft nothing."""
    if not (callable(drafter.propose) and accepts(drafter.propose, None, 1)):
        raise ConfigError(f"drafter {name!r} {what}, whose propose cannot be called as propose(state, k); "
                          f"{expected}")
    return drafter


def valid_draft(proposal: Any, k: int, vocab_size: int, sampled: bool = False,
                draw: bool = True, device: Any = None, sound: bool = False) -> "list[int] | SampledDraft":
    """The longest prefix of a drafter's proposal, k tokens at most, made of token ids of the
    vocabulary: an id past it would fail the verifying forward, so the drafts stop there. A
    `SampledDraft` stays one (its distributions cut alike) where the request `sampled` may take
    one (`samples_drafts`), else its tokens are a plain proposal; it counts as drawn (kept at
    min(1, p/q)) only where the engine asked for a draw (`draw`: DraftInput.draw) and the drafter
    says it drew: a chosen draft taken for a drawn one would skew the output, where a drawn one
    taken for a chosen one (kept where the target's draw equals it) is exact. Its q is moved to
    `device` (the engine's) and, unless the drafter's q is `sound` (the built-in draft models'),
    made a distribution (`sound_q`)."""
    if isinstance(proposal, SampledDraft):
        tokens = valid_draft(proposal.tokens, k, vocab_size)
        if not sampled or not tokens:
            return tokens
        probs = proposal.probs
        # a tensor, told without importing torch: the plugin manager imports this module (through
        # hibana_plugins.options) on every start, where adapters load without torch
        shape = tuple(getattr(probs, "shape", ()))
        if not (hasattr(probs, "index_select") and len(shape) == 2 and shape[0] >= len(tokens)
                and 0 < shape[1] <= vocab_size):
            raise TypeError(f"a SampledDraft of {len(tokens)} tokens holds probs of shape {shape}, where "
                            f"[{len(tokens)}, V <= {vocab_size}] belongs")
        drawn = draw and proposal.drawn is True
        probs = probs[:len(tokens)]
        if not sound:
            probs = sound_q(probs, tokens, drawn, device)
        elif device is not None:
            probs = probs.to(device)
        return SampledDraft(tokens, probs, drawn)
    if proposal is None:
        return []
    if type(proposal) is list and plain_token_ids(proposal[:k], vocab_size):  # the built-ins' (every step)
        return proposal[:k]
    if isinstance(proposal, (str, bytes)):
        raise TypeError(f"a proposal of text ({proposal!r:.40}), where token ids belong")
    if hasattr(proposal, "tolist"):  # a tensor or an array of ids
        proposal = proposal.tolist()
    draft = []
    for token in itertools.islice(proposal, k):
        if not (is_kind(token, int) and 0 <= token < vocab_size):
            if not draft and not is_kind(token, int):  # no id at all: a drafter's bug, said once
                raise TypeError(f"a proposal starting with {token!r:.40}, where token ids (ints) belong")
            break  # (an id past the vocabulary ends the drafts there)
        draft.append(int(token))
    return draft


def sound_q(probs: Any, tokens: list[int], drawn: bool, device: Any = None) -> Any:
    """A plugin's q [n, V] as the sampler may read it: float32 on `device`, NaN, infinite and
    negative entries 0, each row scaled to sum to 1. Verifying a drawn draft at min(1, p/q) is
    exact only for the q it was drawn from: weights left unnormalised kept too few or too many,
    and a row with no mass on its own drawn token kept that token whatever p said. Such a row
    becomes the token alone, which verifies the draft exactly as a chosen one (kept with
    probability p(x), else a draw from p without x)."""
    import torch  # only here: a SampledDraft came, so torch is there (see `valid_draft`)

    q = probs.to(device=device, dtype=torch.float32) if device is not None else probs.float()
    q = q.nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp_(min=0.0)  # [n, V]
    q = q / q.sum(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    if drawn:
        x = torch.tensor(tokens, dtype=torch.int64, device=q.device)[:, None]  # [n, 1]
        alone = torch.zeros_like(q).scatter_(1, x, 1.0)
        q = torch.where(q.gather(1, x) > 0, q, alone)
    return q


class DrawChoice:
    """Whether a state's drafter draws its drafts from q or chooses q's argmax: whichever kept
    more of late, as the target reckons both at every verified first draft (sum(min(p, q)) drawn,
    p(argmax q) chosen: both known wherever q is, so neither needs trying). Draws until it has
    `MIN_SEEN` figures: drawing is speculative sampling's own rule."""

    DECAY = 0.9
    MIN_SEEN = 4

    def __init__(self) -> None:
        self.drawn = self.chosen = 0.0  # decayed sums
        self.seen = 0

    def observe(self, drawn: float, chosen: float) -> None:
        self.drawn = self.DECAY * self.drawn + drawn
        self.chosen = self.DECAY * self.chosen + chosen
        self.seen += 1

    @property
    def draws(self) -> bool:
        return self.seen < self.MIN_SEEN or self.drawn >= self.chosen


class SpeculationCounters:
    def __init__(self) -> None:
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0
        self.verify_steps = 0        # steps that verified drafts
        self.verified_sequences = 0  # (sequence, step) pairs that verified drafts
        self.verified_tokens = 0     # tokens those produced (accepted drafts + one each)
        self.draft_lengths: Counter[int] = Counter()  # k chosen -> how often (adaptive and fixed)


class Speculator:
    def __init__(self, default: SpeculationConfig,
                 drafters: "dict[str, Callable[..., Drafter]] | Callable[[], dict[str, Callable[..., Drafter]]]",
                 profile: Callable[[], StepCostModel], vocab_size: int, engine: Any = None) -> None:
        """`drafters`: the registered drafter factories by name, or what gives them when first named
        (the plugin registry: an engine that never speculates never reads it, so a clash of two
        plugins' drafter names fails only where drafters are used)."""
        self.default = default
        self.vocab_size = vocab_size
        self._registered = drafters
        self._drafters: dict[str, Drafter] = {}
        self._profile = profile
        self._controller: Controller | None = None
        self._engine = engine
        self.counters = SpeculationCounters()
        self.global_stats: dict[str, AcceptanceStats] = {}
        self._stats: "weakref.WeakKeyDictionary[object, dict[str, AcceptanceStats]]" = weakref.WeakKeyDictionary()
        self._draws: "weakref.WeakKeyDictionary[object, DrawChoice]" = weakref.WeakKeyDictionary()
        self._shadows: dict[int, tuple[str, int, list[int]]] = {}  # request id -> (drafter, at, draft)
        self._shadow_turn = 0
        self.drafter_errors: Counter[str] = Counter()  # drafter -> calls that raised
        self._last_shape = (1, 1)  # (step tokens, sequences sampling) of the last plan
        if default.enabled:
            self.check(default)

    # --- configuration ----------------------------------------------------------------------

    @functools.cached_property
    def _factories(self) -> dict[str, Callable[..., Drafter]]:
        return self._registered() if callable(self._registered) else self._registered

    def check(self, config: SpeculationConfig) -> None:
        """A ConfigError, listing the registered drafters, when `config` names none of them. The
        drafter is built here, so a factory's error (a missing or incompatible draft checkpoint)
        shows at construction or submission, not inside a step."""
        config = self.resolve(config)
        if not config.enabled:
            return
        check_method(config, list(self._factories))
        if config.draft_model is not None and not _same_checkpoint(config.draft_model, self.default.draft_model):
            raise ConfigError(f"draft_model={config.draft_model!r} differs from the engine's "
                              f"({self.default.draft_model!r}): the draft model is loaded once per engine; "
                              "give it in Engine.from_pretrained(..., speculation={...}) and leave it out here")
        self.drafter(config.method)

    def config(self, request: "Request") -> SpeculationConfig:
        return self.resolve(request.params.speculation if request.params is not None else None)

    def resolve(self, own: SpeculationConfig | None) -> SpeculationConfig:
        """What a request's setting means here: None, the engine's; "adaptive" (or True) or a dict
        without "method", which name no drafter, the engine's drafter with the request's k (None:
        adaptive)."""
        if own is None:
            return self.default
        if own.engines_drafter and self.default.enabled:
            return dataclasses.replace(self.default, k=own.k)
        return own

    def drafter(self, name: str) -> Drafter:
        drafter = self._drafters.get(name)
        if drafter is None:
            drafter = self._drafters[name] = build_drafter(name, self._factories[name], self._engine)
        return drafter

    def start(self) -> None:
        """Profile the step costs now (at engine start-up) when the engine's default is adaptive,
        so that no agent's first turn pays for it."""
        if self.default.enabled and self.default.k is None:
            _ = self.controller  # built, so profiled, now

    def may_profile(self, running: Sequence["Request"]) -> bool:
        """Whether planning the next step may profile the step costs now (the first speculating
        request of an engine whose default is not adaptive: `draft` plans fixed draft lengths
        through the controller too): building `controller` runs steps."""
        return self._controller is None and any(self.config(r).active for r in running)

    @property
    def controller(self) -> Controller:
        if self._controller is None:  # an engine without adaptive default profiles on first use
            self._controller = Controller(self._profile())
        return self._controller

    def acceptance(self, seq: object) -> dict[str, list[float]]:
        """One state's acceptance rate by draft position, per drafter it drafted with (what the
        controller picks its draft lengths from; shrunk towards the engine-wide rate while the
        state has few tries)."""
        return {method: stats.summary() for method, stats in self._stats.get(seq, {}).items()}

    def stats(self, request: "Request", method: str) -> AcceptanceStats:
        per_state = self._stats.setdefault(request.seq, {})
        stats = per_state.get(method)
        if stats is None:
            prior = self.global_stats.setdefault(method, AcceptanceStats())
            stats = per_state[method] = AcceptanceStats(prior)
        return stats

    # --- schedule ---------------------------------------------------------------------------

    def wants_history(self, running: Sequence["Request"]) -> bool:
        """Whether a running request would draft next step if its tokens were on the host."""
        tokens, sampling = self._last_shape
        for request in running:
            config = self.config(request)
            if not request.samples or not config.active or not request.num_output_placeholders:
                continue
            if config.k is not None:
                return True
            stats = self.stats(request, config.method)
            if self.controller.promising(stats, tokens, sampling):
                return True
            if self._costly(config.method) and stats.probe_due(request.num_tokens):
                return True
        return False

    def draft(self, chunks: Sequence["ScheduledChunk"], step_tokens: int,
              room: Callable[["ScheduledChunk", int], int]) -> "dict[int, list[int] | SampledDraft]":
        """Drafts for this step's chunks, by chunk index (a `SampledDraft` where the drafter drew
        them for a request that may take one). `room(chunk, k)`: how many of k draft tokens the
        chunk can take (budget, KV blocks, max_tokens, context).

        A cheap drafter proposes before the plan (what it found bounds what the plan may take); a
        costly one (`shadows = False`: a draft model's forward a token) after it, for the chunks
        the plan gave drafts only and as many as it gave: a step, or a chunk, planned at k=0 runs
        no draft forward (a draft model catches up on the tokens it missed when next asked)."""
        sampling = sum(c.sample for c in chunks)
        wanted: dict[str, list[tuple[int, int]]] = {}  # method -> (chunk index, tokens wanted)
        for i, chunk in enumerate(chunks):
            request = chunk.request
            config = self.config(request)
            if not chunk.sample or not config.active or chunk.end != len(request.seq):
                continue
            most = config.k if config.k is not None else MAX_DRAFT
            if config.k is None and self._costly(config.method):
                # a costly drafter's plan considers what can pay, and one more
                most = 1 + self.controller.ceiling(self.stats(request, config.method), step_tokens, sampling,
                                                   MAX_DRAFT - 1)
            want = room(chunk, most)
            if want > 0:
                wanted.setdefault(config.method, []).append((i, want))
        candidates: list[tuple[int, list[int] | SampledDraft | None, Candidate]] = []  # None: drafted after the plan
        for method, items in wanted.items():
            if self._costly(method):
                candidates.extend((i, None, Candidate(self.stats(chunks[i].request, method), want,
                                                      self.config(chunks[i].request).k)) for i, want in items)
                continue
            inputs = [self._input(chunks[i].request) for i, _ in items]
            for (i, want), proposal in zip(items, self._propose(method, inputs, [w for _, w in items])):
                proposal = self._allowed(chunks[i].request, method, proposal)
                candidates.append((i, proposal, Candidate(self.stats(chunks[i].request, method), len(proposal),
                                                          self.config(chunks[i].request).k)))
        if not candidates:
            return {}
        self._last_shape = (step_tokens, sampling)
        ks = self.controller.plan([c for _, _, c in candidates], step_tokens, sampling)
        later: dict[str, list[tuple[int, int]]] = {}  # costly drafters: method -> (chunk index, k planned)
        drafts = {}
        for (i, proposal, candidate), k in zip(candidates, ks):
            if (proposal is None and k == 0 and candidate.fixed is None
                    and candidate.stats.probe(len(chunks[i].request.seq))):
                k = 1  # a costly drafter's probe, lest its figures freeze where they fell
            if proposal is None and k > 0:
                later.setdefault(self.config(chunks[i].request).method, []).append((i, k))
                continue
            self.counters.draft_lengths[k] += 1
            if k > 0:
                drafts[i] = cut(proposal, k)
        for method, items in later.items():
            inputs = [self._input(chunks[i].request) for i, _ in items]
            for (i, k), proposal in zip(items, self._propose(method, inputs, [k for _, k in items])):
                proposal = cut(self._allowed(chunks[i].request, method, proposal), k)
                self.counters.draft_lengths[len(proposal)] += 1
                if proposal:
                    drafts[i] = proposal
        return drafts

    def _costly(self, method: str) -> bool:
        """Whether the drafter's proposals cost forwards (`shadows = False`, a draft model's)."""
        return not getattr(self.drafter(method), "shadows", True)

    def _allowed(self, request: "Request", method: str,
                 proposal: "list[int] | SampledDraft") -> "list[int] | SampledDraft":
        """A proposal cut at the first token the request's grammar forbids (token ids: `_input`);
        an empty one, of an adaptive request, counts as a miss: it is what drafting gets."""
        if request.grammar is not None:
            proposal = proposal[:request.grammar.valid_prefix(proposal)]
        if not proposal and self.config(request).k is None:
            self.stats(request, method).record(1, 0)
        return proposal

    def _propose(self, method: str, inputs: list[DraftInput], ks: list[int]) -> "list[list[int] | SampledDraft]":
        """Proposals of one drafter for several states: in one call where the drafter batches
        (`propose_many`, e.g. a draft model's forward), else one by one. Drafters are plugins and
        drafts change speed only, so one that raises drafts nothing (with a warning) rather than
        failing the step, whose other requests may not even speculate."""
        drafter = self.drafter(method)
        call = "propose"
        try:
            many = getattr(drafter, "propose_many", None)
            call = "propose" if many is None else "propose_many"
            proposals = many(inputs, ks) if many is not None else [
                drafter.propose(state, k) for state, k in zip(inputs, ks)]
        except BaseException as exc:  # noqa: BLE001 - any bug of a plugin's drafter (`_unless_interrupt`)
            _unless_interrupt(exc)
            self._drafter_failed(method, call, exc)
            return [[] for _ in inputs]
        try:
            if not isinstance(proposals, (list, tuple)) or len(proposals) != len(inputs):
                raise TypeError(f"{describe_registered(proposals)} for {len(inputs)} states, where a list of one "
                                "proposal a state belongs")
            device, sound = getattr(self._engine, "device", None), getattr(drafter, "sound_q", False) is True
            return [valid_draft(p, k, self.vocab_size, samples_drafts(state.params), state.draw, device, sound)
                    for p, k, state in zip(proposals, ks, inputs)]
        except Exception as exc:  # noqa: BLE001 - what a plugin's drafter returned
            self._drafter_failed(method, call, exc, returned=True)
            return [[] for _ in inputs]

    def _drafter_failed(self, method: str, call: str, exc: BaseException, returned: bool = False) -> None:
        if not self.drafter_errors[method]:
            skipped = ("its requests decode without its drafts" if call.startswith("propose")
                       else f"its {call}() is skipped")
            what = f"{call} returned what Hibana cannot read: {exc}" if returned else f"raised in {call}: {exc!r}"
            warnings.warn(f"Hibana drafter {method!r} {what}; {skipped} (output is unchanged)",
                          PluginWarning, stacklevel=2)
        self.drafter_errors[method] += 1

    def _input(self, request: "Request") -> DraftInput:
        """What a drafter sees of a request's state: whether to draw (`DrawChoice`), and its params
        where it may take drawn drafts (`samples_drafts`), but not under a grammar, which cuts
        drafts by their values (a drawn draft the grammar forbids is a rejection, after which the
        target draws from the residual, not from p), nor under trace replay, whose outputs are
        forced (a drawn draft would be kept where it equals the forced token, at sum(p q) where a
        real run keeps sum(min(p, q))). The proposals of a request given no params are token ids
        alone (`valid_draft`)."""
        params = request.params if request.grammar is None and request.forced is None else None
        choice = self._draws.get(request.seq) if params is not None else None
        return DraftInput(TokensView(request.seq.tokens), request.seq, request.seq.edits, params,
                          choice is None or choice.draws)

    # --- update -----------------------------------------------------------------------------

    def verified(self, chunk: "ScheduledChunk", sampled: Sequence[int], kept: int | None = None,
                 estimate: tuple[float, float] | None = None) -> None:
        """A chunk's drafts were verified: `sampled` = the accepted drafts and one more token, of
        which the request kept the first `kept` (a stop token, a stop string or max_tokens among
        them ends it; None: all). The drafter's acceptance (what the controller plans with) counts
        every draft the target agreed with; the engine's counters what the request kept.
        `estimate`: where the drafts came with q, what drawing and choosing keep at the first
        (`DrawChoice`)."""
        if estimate is not None:
            choice = self._draws.get(chunk.request.seq)
            if choice is None:
                choice = self._draws[chunk.request.seq] = DrawChoice()
            choice.observe(*estimate)
        k, agreed = len(chunk.draft_token_ids), max(0, len(sampled) - 1)
        kept = len(sampled) if kept is None else min(kept, len(sampled))
        config = self.config(chunk.request)
        self.stats(chunk.request, config.method).record(k, agreed)
        c = self.counters
        c.draft_tokens_proposed += k
        c.draft_tokens_accepted += min(agreed, kept)
        c.verified_sequences += 1
        c.verified_tokens += kept

    def observe_step(self, num_tokens: int, verify: bool, seconds: float | None) -> None:
        """A step of `num_tokens` tokens took `seconds` on the device (None: a step that does
        not stand for the steps speculation plans, e.g. one that captured a CUDA graph)."""
        self.counters.verify_steps += verify
        if seconds is not None and self._controller is not None:
            self._controller.costs.observe(num_tokens, seconds)

    def observe_host(self, seconds: float) -> None:
        """Scheduling and launching a step took `seconds` of host time (under async scheduling,
        what a verifying step adds: the next step's host work waits for its tokens)."""
        if self._controller is not None:
            self._controller.costs.observe_sync(seconds)

    def updated(self, chunks: Sequence["ScheduledChunk"]) -> None:
        """A step's tokens reached the host: shadow proposals are checked against them and a few
        new ones made for plain decodes of adaptive requests."""
        made = 0
        n = len(chunks)
        for j in range(n):
            chunk = chunks[(self._shadow_turn + j) % n]  # round robin over the batch
            request = chunk.request
            shadow = self._shadows.get(request.id)
            if shadow is not None:
                method, at, draft = shadow
                known = request.seq.tokens[at:at + len(draft)]
                hits = next((i for i, (a, b) in enumerate(zip(known, draft)) if a != b), len(known))
                if hits < len(known) or len(known) == len(draft) or request.finished:
                    self.stats(request, method).record(len(draft), hits)
                    del self._shadows[request.id]
                continue
            config = self.config(request)
            if (made >= SHADOW_PER_STEP or request.finished or not config.adaptive
                    or not chunk.sample or chunk.draft_token_ids):
                continue
            if not getattr(self.drafter(config.method), "shadows", True):  # a proposal costs forwards
                continue
            made += 1
            proposal, = self._propose(config.method, [self._input(request)], [MAX_DRAFT])
            draft = _tokens(proposal)
            if draft:
                self._shadows[request.id] = (config.method, len(request.seq), draft)
            else:
                self.stats(request, config.method).record(1, 0)
        self._shadow_turn += 1

    def finished(self, request: "Request") -> None:
        self._shadows.pop(request.id, None)
        config = self.config(request) if request.params is not None else None
        if config is None or not config.enabled or not request.output:
            return
        seq = request.seq
        context = seq.tokens[max(0, request.num_prompt - 32):request.num_prompt]
        finished = getattr(self.drafter(config.method), "finished", None)  # optional: not every drafter learns
        if finished is None:
            return
        try:
            finished(context, TokensView(request.output))
        except BaseException as exc:  # noqa: BLE001 - as in `_propose`: a drafter's bug costs speed only
            _unless_interrupt(exc)
            self._drafter_failed(config.method, "finished", exc)

    def _optional(self, method: str, call: str) -> Any:
        """A drafter's optional `call()` (`summary`, `resident_bytes`, `close`), or None where it
        has none or it raised: a plugin's bug there fails no engine call (`stats`, `memory`,
        `close`), as one in `propose` fails no step."""
        bound = getattr(self._drafters[method], call, None)
        try:
            return None if bound is None else bound()
        except Exception as exc:  # noqa: BLE001 - as in `_propose`
            self._drafter_failed(method, call, exc)
            return None

    def resident_bytes(self) -> int:
        """Device bytes the drafters in use hold (a draft model's weights and KV)."""
        return sum(self._optional(method, "resident_bytes") or 0 for method in self._drafters)

    def close(self) -> None:
        """The engine closes: drafters that hold memory (a draft model's weights and KV) free it."""
        for method in self._drafters:
            self._optional(method, "close")
        self._drafters.clear()

    def _drawn_or_chosen(self) -> dict[str, int]:
        """States whose drafter said q, by what they do now. (A state collected on another thread,
        its handle dropped outside the engine's lock, may leave the weak dictionary mid-count.)"""
        for _ in range(3):
            try:
                return dict(Counter("drawn" if c.draws else "chosen" for c in list(self._draws.values())))
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        return {}

    def summary(self) -> dict:
        c = self.counters
        own = {name: figures for name in self._drafters if (figures := self._optional(name, "summary")) is not None}
        return {
            "default": "off" if not self.default.enabled else
                       ("adaptive" if self.default.k is None else f"k={self.default.k}") + f" ({self.default.method})",
            "draft_lengths": dict(sorted(c.draft_lengths.items())),
            "acceptance_rate": c.draft_tokens_accepted / c.draft_tokens_proposed if c.draft_tokens_proposed else None,
            "tokens_per_verify": c.verified_tokens / c.verified_sequences if c.verified_sequences else None,
            "acceptance_by_position": {m: s.summary() for m, s in self.global_stats.items()},
            "step_cost_ms": None if self._controller is None else {
                "tokens": self._controller.costs.points,
                "device": [round(1e3 * s, 3) for s in self._controller.costs.seconds],
                "verify_sync": round(1e3 * self._controller.costs.sync_overhead, 3)},
            "drafters": own,  # a drafter's own figures (`summary()`), e.g. a draft model's cost per token
            # states whose drafter said q: how many draw their drafts now, how many choose q's argmax
            "drawn_or_chosen": self._drawn_or_chosen(),
            "drafter_errors": dict(self.drafter_errors),  # calls that raised, per drafter
        }


def _tokens(proposal: "list[int] | SampledDraft") -> list[int]:
    return proposal.tokens if isinstance(proposal, SampledDraft) else proposal


PROFILE_ROUNDS = 3
"""Timings per token count in the start-up profile of step costs (the best one counts)."""
PROFILE_SECONDS = 2.0
"""About as long as the start-up profile's timed steps may take, its warm-ups (kernels compiling)
apart: the ladder stops growing once its timings so far, taken `rounds` times, would outlast it,
and the rounds stop once it is spent. A CPU running a large model takes seconds a 256-token step
(the whole ladder, four times over, took minutes), and a busy one several times as long as an idle
one (the demo's warm-up took 23 s to 154 s with other work on the machine). The counts left untimed
follow the line through the last two timed ones: a step that reads its weights once costs little
more for a few tokens more, where cost in proportion to tokens (`StepCostModel` past its points)
would make a verify step look too dear to run, and so it would never be timed to correct it."""


def profile_step_costs(forward: Callable[[int], None], max_tokens: int, sync: Callable[[], None],
                       rounds: int = PROFILE_ROUNDS, budget: float = PROFILE_SECONDS) -> StepCostModel:
    """Time `forward(num_tokens)` on the device at a ladder of token counts: a coarse prior, which
    the steps the engine runs then refine (`StepCostModel.observe`). Each count's best of `rounds`
    timings, taken round after round over the whole ladder, so that a burst of other work on the
    machine slows one timing of several counts rather than every timing of a few (best of two in
    a row timed 2- to 256-token steps 50x too slow on a busy CPU: verify steps looked too dear
    to run, and so were never timed again). Its timed steps take about `budget` seconds at most
    (PROFILE_SECONDS)."""
    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        forward(n)
        sync()
        return time.perf_counter() - start

    ladder = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= max(max_tokens, 1)]
    seconds: list[float] = []
    for n in ladder:
        if seconds and sum(seconds) * rounds > budget:
            break
        forward(n)  # warm up (kernels compile, caches fill), then the first timing
        seconds.append(timed(n))
    spent, points = sum(seconds), ladder[:len(seconds)]
    for _ in range(rounds - 1):
        if spent > budget:
            break
        for i, n in enumerate(points):
            taken = timed(n)
            seconds[i], spent = min(seconds[i], taken), spent + taken
    if len(points) < len(ladder):  # untimed: on the line through the last two timings (PROFILE_SECONDS)
        slope = (seconds[-1] - seconds[-2]) / (points[-1] - points[-2]) if len(points) > 1 else 0.0
        seconds += [seconds[-1] + max(slope, 0.0) * (n - points[-1]) for n in ladder[len(points):]]
    return StepCostModel(ladder, seconds, sync_overhead=0.1 * seconds[0])
