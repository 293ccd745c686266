"""The draft-model drafter: a second, smaller checkpoint with the same tokenizer.

    propose_many(states, ks)
      sync      one draft KVSequence per target state, holding its history (kept across calls,
                so only the tokens appended since the last call are computed)
      room      blocks for each tail and its k - 1 fed drafts; the draft KV of states not in this
                call is dropped, least recently used first, when the pool runs short
      catch up  all tails in one forward (chunked under the token budget when long); the logits
                at each history's end give draft 1
      decode    k_max - 1 batched steps, each feeding back the previous draft on the device (no
                host sync until the end); states wanting fewer drafts leave early (sorted by k)
      trim      one read-back of all drafts; the draft KV keeps the history only

A hybrid draft model (Qwen3.5's small ones for a Qwen3.5 target: the only checkpoints that share
its tokenizer; or a hybrid target's own layer-skip draft, `surgery.layer_skip`) keeps each state's
linear-attention state in a slot of its own recurrent cache,
valid at the history's end but one: catching up stops a token short, each drafting state's slot is
copied to a scratch slot, and the last history token and the drafts run there (the live state
never takes in a draft, and no history token is computed twice). Idle states give their slots
back least recently used first, as their KV.

Each draft is the draft model's argmax, or, for a request that samples without a seed or history
penalties (`samples_drafts`), a draw from the draft model's distribution q under the request's
temperature, top-k, top-p and min-p, returned with q (`SampledDraft`). A chosen draft is kept
where the target's own draw equals it (a seeded request's tokens are the same with speculation
on or off); a drawn one with probability min(1, p/q), the first rejected replaced by a draw from
max(0, p - q) (`Sampler`). Either way output is the target's, token for token under greedy and in
distribution under sampling, and a draft model changes speed only; drawing keeps more drafts
where q is close to p (all of them where they are equal) than the argmax, which is kept at the
rate p gives it.

The forwards reuse the engine's `ModelRunner` (batch tensors, CUDA graphs of decode steps) on the
draft model's own `ForwardContext` and `KVCache`; nothing of the scheduler is involved.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError, MemoryBudgetError
from hibana_core.forward_context import ForwardContext
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.cache import KVCache, kv_cache_dtype
from hibana_core.kv.recurrent import MIN_STATE_SLOTS, RecurrentSlots, RecurrentState, slots_within
from hibana_core.kv.recurrent_cache import RecurrentCache
from hibana_core.kv.sequence import KVSequence, LongRope
from hibana_core.kv.transfers import device_tensor
from hibana_core.loader import LoadedModel, load_model, model_bytes
from hibana_core.models.decoder import kv_layers, longrope_switch, rotary_bytes, rotary_positions, size_rotary
from hibana_core.runner import DeviceInput, ModelRunner, StepData
from hibana_core.sampler import apply_logit_bias, apply_warpers, draw, make_generator
from hibana_core.speculation.drafters import DraftInput, SampledDraft, samples_drafts


@dataclass
class DraftCounters:
    calls: int = 0
    tokens_drafted: int = 0
    tokens_prefilled: int = 0  # history tokens the draft model caught up with
    forwards: int = 0
    seconds: float = 0.0       # wall time in propose_many, the final read-back included
    evictions: int = 0         # idle states whose draft KV was dropped for room
    skipped: int = 0           # states that got no draft (no room, context full)


@dataclass(slots=True)
class _Entry:
    """One target state's draft KV."""

    ref: weakref.ref  # to the state
    seq: KVSequence
    version: int      # the state's version that seq.tokens follows


@dataclass
class _Work:
    index: int        # position in the call's states
    seq: KVSequence
    k: int
    start: int        # first position computed in this call
    end: int          # history length
    request: SamplingParams | None = None  # the request's own: its logit_bias moves every draft
    draw: bool = True                      # drafts drawn from q (False: q's argmax)
    scratch: int = -1                      # a hybrid draft model's: the slot the drafting steps run in

    @property
    def params(self) -> SamplingParams | None:
        """q under the request's warpers where it samples its drafts (`samples_drafts`); None: the argmax alone."""
        return self.request if samples_drafts(self.request) else None


class _OnDevice(NamedTuple):
    """Last step's drafts, as `ModelRunner.take_from_device` reads a previous step's tokens."""

    sampled: torch.Tensor  # [m]


def check_same_tokenizer(engine: Any, draft: LoadedModel, path: str) -> None:
    """A ConfigError naming both checkpoints unless the draft model speaks the target's tokens:
    equal vocabularies when both have a tokenizer (embedding sizes may differ by padding, as
    within the Qwen2.5 family), else equal vocab sizes."""
    target, mine = engine.tokenizer, draft.tokenizer
    if target is not None and mine is not None:
        tv, dv = target.get_vocab(), mine.get_vocab()
        if tv == dv:
            return
        token = next((t for t in dv if tv.get(t) != dv[t]), None) or next(t for t in tv if t not in dv)
        detail = (f"their vocabularies differ ({len(tv)} and {len(dv)} tokens; e.g. {token!r} is "
                  f"{tv.get(token)} in the target and {dv.get(token)} in the draft)")
    elif engine.vocab_size == draft.args.vocab_size:
        return
    else:
        detail = (f"vocab sizes {engine.vocab_size} and {draft.args.vocab_size} differ (and no pair of "
                  "tokenizers to compare)")
    raise ConfigError(f"draft model {path!r} does not share the tokenizer of the target "
                      f"{engine.config.model!r}: {detail}; pick a draft checkpoint of the target's family")


SNAPSHOT_AFTER = 32
"""A hybrid draft model's state is snapshotted after a call that caught up more tokens than
this: a new prompt (tool output, a user turn), where generation appends a few tokens a call. A
chat template that re-renders the last reply then costs the tokens after the prompt's end only
(`RecurrentState.rewind`), as for the target's state."""

DRAFT_KV_SHARE = 0.25
"""A draft model's KV bytes as a share of the target's (the memory budget counts them)."""

_UNBIASED = SamplingParams()  # a row whose request is unknown, in `apply_logit_bias`


class DraftReserve(NamedTuple):
    """What a memory budget holds for the drafter the engine names, when it runs a model of its
    own: its weights as they load, and its KV and a hybrid draft's states (`DraftModelDrafter`'s
    sizing: `share` of the target's KV bytes, `least_bytes` at the least: KV for one full-context
    sequence, and a hybrid draft model's fewest state slots)."""

    method: str
    weight_bytes: int
    least_bytes: int
    share: float


def least_blocks(max_len: int, block_size: int) -> int:
    """A drafter's KV blocks at the least: one sequence of `max_len` tokens, and a block to grow."""
    return -(-max_len // block_size) + 1


def draft_reserve(engine: Any, kv_dtype: torch.dtype) -> DraftReserve | None:
    """The reserve for the drafter the engine's `speculation` names, where it is a draft model
    (its weights in the engine's dtype, as they will load: a bfloat16 draft on the CPU takes
    float32's bytes; a quantized one counted dense, at most what it takes) or the layer-skip
    self-draft (the target's weights; KV for its kept layers, in the target's KV dtype); None
    for drafters without a model."""
    spec = engine.config.speculation
    if not spec.enabled or spec.method not in ("draft_model", "layer_skip"):
        return None
    if spec.method == "draft_model":
        if not spec.draft_model:
            return None  # the drafter refuses it, saying what to give
        from hibana_core.loader import planned_model

        weights, args = planned_model(spec.draft_model, engine.dtype, engine.max_model_len)  # (as it drafts)
        layers, kv_dtype = kv_layers(args), engine.dtype  # (a hybrid's attention layers)
        linear = getattr(args, "linear_attention", None)  # a hybrid's fewest state slots, and the scratch one
        states = 0 if linear is None else (MIN_STATE_SLOTS + 1) * RecurrentCache.slot_bytes(
            [linear.shape] * sum(linear.layers), engine.dtype)
    else:
        from hibana_core.surgery.layer_skip import DEFAULT_KEEP, kept_count

        weights, args, states = 0, engine.model_args, 0
        # every kept layer counted as an attention layer (which a hybrid's are is known once ranked): its
        # kept linear-attention layers' fewest state slots take less than a sequence's KV of a layer
        layers = kept_count(args.num_layers, DEFAULT_KEEP)
    bs = engine.config.cache.block_size
    max_len = min(engine.max_model_len, args.max_position_embeddings)
    per_block = KVCache.bytes_per_block(layers, bs, args.num_kv_heads, args.head_dim, kv_dtype)
    return DraftReserve(spec.method, weights, least_blocks(max_len, bs) * per_block + states, DRAFT_KV_SHARE)


def check_reserved(engine: Any, method: str) -> None:
    """A MemoryBudgetError where the engine has a memory budget that holds no room for this
    drafter's model and KV: the budget reserves them for the drafter the engine names, and one
    a request alone names would take memory past it."""
    if getattr(engine, "memory_budget", None) is None:
        return
    reserve = getattr(engine, "draft_reserve", None)
    if reserve is not None and reserve.method == method:
        return
    raise MemoryBudgetError(f"the {method} drafter runs a model with KV of its own, and memory_budget="
                            f"{engine.config.cache.memory_budget!r} holds no room for it (the budget holds the "
                            "draft_model or layer_skip drafter that the engine's speculation names); name it on the "
                            f"engine (speculation={{'method': {method!r}}}) so that the budget holds it, or leave it "
                            "out of the request")


class DraftModelDrafter:
    """Drafts with a smaller checkpoint of the target's family, on the engine's device and dtype.

    `model`: its checkpoint directory (default: the engine's `speculation.draft_model`).
    `num_blocks`: its KV blocks; None: `kv_share` of the target's KV bytes, at least one
    full-context sequence, at most as many blocks as the target has.
    """

    shadows = False
    """No free "shadow" proposals for the controller: each costs draft-model forwards."""
    method = "draft_model"
    """The speculation method this drafter is (the memory budget reserves for the engine's)."""
    sound_q = True
    """Its q rows are softmaxes on the engine's device: the speculator takes them as they are
    (a plugin's are made distributions first, `speculator.sound_q`)."""

    def __init__(self, engine: Any, model: str | None = None, num_blocks: int | None = None,
                 kv_share: float = DRAFT_KV_SHARE, loaded: LoadedModel | None = None, ctx: ForwardContext | None = None) -> None:
        """`loaded` and `ctx`: a model already built on its own ForwardContext (the layer-skip
        self-draft) instead of a checkpoint to load."""
        check_reserved(engine, self.method)
        if loaded is None:
            path = model if model is not None else engine.config.speculation.draft_model
            if not path:
                raise ConfigError("speculation method 'draft_model' needs a draft checkpoint: "
                                  "Engine.from_pretrained(target, speculation={'method': 'draft_model', "
                                  "'draft_model': path, 'k': 4})")
            self.path = str(path)
            self.ctx = ForwardContext()
            loaded = load_model(self.path, engine.device, str(engine.dtype).removeprefix("torch."), self.ctx,
                                engine.config.progress)
            check_same_tokenizer(engine, loaded, self.path)
            # its rotary tables as long as it drafts (the layer-skip draft shares the target's, sized already)
            size_rotary(loaded.model, rotary_positions(min(engine.max_model_len, loaded.args.max_position_embeddings),
                                                       loaded.args))
            self.weight_bytes = model_bytes(loaded.model) + rotary_bytes(loaded.model)
            """Bytes of weights (and rotary tables) this drafter holds itself (none where it shares the target's)."""
        else:
            self.weight_bytes = 0
            self.path, self.ctx = model or "(built in memory)", ctx
        self.vocab_size = min(engine.vocab_size, loaded.args.vocab_size)  # drafts are ids both know
        # history ids past the draft's embedding (padding ids of a larger target) are clamped
        self._cap = loaded.args.vocab_size - 1 if engine.vocab_size > loaded.args.vocab_size else None
        self.max_len = min(engine.max_model_len, loaded.args.max_position_embeddings)
        switch = longrope_switch(loaded.args)
        self.long_rope = (None if switch is None else  # (a LongRoPE target's max_len is its max_model_len)
                          LongRope(switch, rotary_positions(self.max_len, loaded.args), loaded.args.longrope_recompute))
        """The draft model's own LongRoPE: its states hold the rotation their target's state holds
        (a history past the switch rotated per position drafts what a long-rotated target would not)."""
        a, bs, sched = loaded.args, engine.config.cache.block_size, engine.config.scheduler
        kv_dtype = kv_cache_dtype(loaded.model, loaded.dtype)  # fp8 for layer-skip on a kv8 target
        layers = kv_layers(a)  # (a hybrid's attention layers)
        per_block = KVCache.bytes_per_block(layers, bs, a.num_kv_heads, a.head_dim, kv_dtype)
        agent_bytes = int(kv_share * engine.kv_cache.nbytes)  # its KV, and a hybrid's states in part of it
        least = least_blocks(self.max_len, bs)
        state_bytes = agent_bytes
        if getattr(engine, "memory_budget", None) is not None:  # within what its least KV leaves, too: the
            # budget holds max(agent_bytes, the least KV and the fewest slots) for it (`draft_reserve`)
            state_bytes = min(agent_bytes, 2 * max(agent_bytes - least * per_block, 0))
        self.states = self._recurrent_cache(loaded, state_bytes, sched.max_concurrent_agents, engine.device)
        if num_blocks is None and not per_block:  # no attention layer (a hybrid's layer-skip draft of linear
            num_blocks = engine.pool.num_blocks  # layers alone): its blocks take no memory, they only count positions
        elif num_blocks is None:
            share = (agent_bytes - (0 if self.states is None else self.ctx.recurrent.nbytes)) // per_block
            num_blocks = min(engine.pool.num_blocks, max(share, least))
        try:
            self.kv_cache = KVCache(layers, num_blocks, bs, a.num_kv_heads, a.head_dim, kv_dtype, engine.device)
        except (RuntimeError, MemoryError) as exc:
            raise MemoryBudgetError(f"cannot allocate the draft model's {num_blocks:,} KV blocks "
                                    f"({num_blocks * per_block:,} bytes) on {engine.device}: {exc}") from None
        self.ctx.kv_cache = self.kv_cache
        self.pool = BlockPool(num_blocks, bs)
        self.runner: ModelRunner | None = ModelRunner(loaded.model, self.ctx, None, engine.device, self.max_len,
                                                      sched.max_concurrent_agents, engine.config.cuda_graphs)
        self.device = engine.device
        self.max_tokens = sched.max_num_batched_tokens  # tokens per forward while catching up
        self._states: OrderedDict[int, _Entry] = OrderedDict()  # id(state) -> entry, LRU first
        self._dead: list[tuple[int, weakref.ref]] = []  # states collected since the last call
        self.generator = make_generator(engine.config.seed + 1, engine.device)  # drawn drafts' noise
        self.counters = DraftCounters()

    def _recurrent_cache(self, loaded: LoadedModel, agent_bytes: int, max_agents: int,
                         device: torch.device) -> RecurrentSlots | None:
        """A hybrid draft model's state slots (None for others): a live one per state it follows
        and a scratch one per state drafting in a call, 2 x max_agents + 1 within agent_bytes (its share
        of the memory: `slots_within`)."""
        shapes = getattr(loaded.model, "recurrent_shapes", None)
        if not shapes:
            return None
        slot = RecurrentCache.slot_bytes(shapes, loaded.dtype)
        slots = slots_within(2 * max_agents + 1, agent_bytes, slot)
        try:
            self.ctx.recurrent = RecurrentCache(shapes, slots, loaded.dtype, device)
        except (RuntimeError, MemoryError) as exc:
            raise MemoryBudgetError(f"cannot allocate the draft model's {slots + 1} linear-attention state slots "
                                    f"({(slots + 1) * slot:,} bytes) on {device}: {exc}") from None
        return RecurrentSlots(slots, self.ctx.recurrent.copy)

    def propose(self, state: DraftInput, k: int) -> list[int]:
        return self.propose_many([state], [k])[0]

    def finished(self, context: Sequence[int], output: Sequence[int]) -> None:
        pass

    @torch.inference_mode()
    def propose_many(self, states: Sequence[DraftInput], ks: Sequence[int]) -> list[list[int] | SampledDraft]:
        out: list[list[int] | SampledDraft] = [[] for _ in states]
        if self.runner is None:  # closed
            return out
        began = time.perf_counter()
        self._reap()
        work = self._admit(states, ks)
        if work:
            try:
                drafts = self._run(work)
            except BaseException:
                for w in work:  # its KV may be half written: recomputed next time
                    w.seq.release()
                raise
            finally:
                for w in work:
                    if w.scratch >= 0:
                        self.states.free(w.scratch)
            for w, draft in zip(work, drafts):
                out[w.index] = draft
                held = self._held(w)
                w.seq.mark_computed(held - w.start)
                w.seq.commit_full_blocks()
                w.seq.trim_kv(held)  # the drafts' KV goes; the next call starts from the history
                if w.seq.recurrent is not None and held - w.start > SNAPSHOT_AFTER:
                    w.seq.recurrent.snapshot()  # a new prompt's end: where a re-rendered history goes back to
        c = self.counters
        c.calls += 1
        c.tokens_drafted += sum(len(d) for d in out)
        c.tokens_prefilled += sum(w.end - w.start for w in work)
        c.seconds += time.perf_counter() - began
        return out

    def _sequence(self, state: DraftInput) -> KVSequence:
        """The state's draft sequence, holding exactly its history (KV of the common prefix kept)."""
        key = id(state.key)
        entry = self._states.get(key)
        if entry is None or entry.ref() is not state.key:  # new, or an id reused after collection
            if entry is not None:
                entry.seq.release()
            dead = self._dead  # the callback must not hold self
            ref = weakref.ref(state.key, lambda r, key=key: dead.append((key, r)))
            seq = KVSequence(self.pool, self.kv_cache.copy_block, long_rope=self.long_rope,
                             recurrent=None if self.states is None else RecurrentState(self.states))
            entry = self._states[key] = _Entry(ref, seq, -1)
        self._states.move_to_end(key)
        seq, tokens = entry.seq, state.tokens
        if entry.version == state.version and len(seq.tokens) <= len(tokens):
            seq.append(tokens[len(seq.tokens):])  # only appended since: O(new tokens)
        else:
            seq.set_tokens(tokens)
        entry.version = state.version
        # LongRoPE: the rotation the target's state holds (KV of the other one dropped); a target's
        # state that does not say, the rotation the history asks for
        target_long = getattr(state.key, "rotated_long", None)
        if target_long is None:
            seq.begin_request()
        else:
            seq.hold_rotation(target_long)
        return seq

    def _reap(self) -> None:
        """Free the draft KV of states that were collected (closed handles, finished forks)."""
        while self._dead:
            key, ref = self._dead.pop()
            entry = self._states.get(key)
            if entry is not None and entry.ref is ref:
                del self._states[key]
                entry.seq.release()

    def _admit(self, states: Sequence[DraftInput], ks: Sequence[int]) -> list[_Work]:
        """Sync each state's sequence and reserve its blocks; those that do not fit get no draft.
        Sorted by k, longest first, so the states still drafting at a step are a prefix."""
        chosen = [(i, min(k, self.max_len - len(s.tokens))) for i, (s, k) in enumerate(zip(states, ks))
                  if len(s.tokens) > 0]
        chosen = [(i, k) for i, k in chosen if k > 0]
        self.counters.skipped += len(states) - len(chosen)
        seqs = {i: self._sequence(states[i]) for i, _ in chosen}
        busy = {id(states[i].key) for i, _ in chosen}
        work: list[_Work] = []
        try:
            for i, k in sorted(chosen, key=lambda c: -c[1]):
                seq = seqs[i]
                end = len(seq.tokens)
                seq.trim_kv(min(seq.num_computed, end - 1))  # the last token's logits give draft 1
                seq.prefer_index(end - 1)
                seq.reuse_cached_blocks(end - 1)
                writes = end - seq.num_computed + k - 1  # the tail and every draft but the last
                slots = 0 if seq.recurrent is None else (seq.recurrent.slot is None) + 1  # live, and scratch
                if not self._room(seq.blocks_needed(writes), busy, slots):
                    seq.release()
                    self.counters.skipped += 1
                    continue
                seq.prepare_write(writes)
                scratch = -1
                if seq.recurrent is not None:
                    seq.recurrent.ensure_slot()
                    scratch = self.states.allocate()
                work.append(_Work(i, seq, k, seq.num_computed, end, states[i].params, states[i].draw, scratch))
        except BaseException:  # the scratch slots taken so far go back
            for w in work:
                if w.scratch >= 0:
                    self.states.free(w.scratch)
            raise
        return work

    def _room(self, blocks: int, busy: set[int], slots: int = 0) -> bool:
        """Whether `blocks` can be allocated (and `slots` state slots taken), after dropping a
        hybrid's snapshots (LRU first, a drafting state's too: a re-rendered history's fallback
        only) and then idle states' KV and slots (LRU first)."""
        def fits() -> bool:
            return self.pool.can_allocate(blocks) and (not slots or self.states.num_free >= slots)

        for entry in self._states.values() if slots else ():
            if self.states.num_free >= slots:
                break
            entry.seq.recurrent.drop_snapshots()
        for key, entry in self._states.items():
            if fits():
                break
            if key not in busy and (entry.seq.num_blocks or (entry.seq.recurrent and entry.seq.recurrent.num_slots)):
                entry.seq.release()
                self.counters.evictions += 1
        return fits()

    def _held(self, w: _Work) -> int:
        """Where a state's draft sequence stands after a call: its history's end, or for a hybrid
        draft model one token short (its live state is there; the last token runs in the
        drafting steps, on a copy)."""
        return w.end - (self.states is not None)

    def _run(self, work: list[_Work]) -> list[list[int] | SampledDraft]:
        drafts = torch.zeros(len(work), work[0].k, dtype=torch.long, device=self.device)  # [S, k_max]
        slots = {w.index: slot for slot, w in enumerate(w for w in work if w.params is not None)}
        # q of every drawn draft: [drawn states, k_max, vocab]
        probs = torch.empty(len(slots), work[0].k, self.vocab_size, device=self.device) if slots else None
        at = [w.start for w in work]
        while any(a < self._held(w) for a, w in zip(at, work)):  # catch up, chunked under the token budget
            budget, parts, done = self.max_tokens, [], []  # done: (part row, state row)
            for j, w in enumerate(work):
                take = min(self._held(w) - at[j], budget)
                if take <= 0:
                    continue
                parts.append((w.seq, at[j], at[j] + take, self._ids(w.seq, at[j], at[j] + take), self._live(w)))
                at[j] += take
                budget -= take
                if at[j] == w.end:
                    done.append((len(parts) - 1, j))
            logits = self._forward(parts)
            if done:
                rows = device_tensor([r for r, _ in done], torch.long, self.device)
                tokens = self._pick(logits.index_select(0, rows), [work[j] for _, j in done], probs, slots, 0)
                drafts[device_tensor([j for _, j in done], torch.long, self.device), 0] = tokens
        if self.states is not None:  # the drafting steps on a copy of each live state, the last token first
            self.ctx.recurrent.copy_many([w.seq.recurrent.slot for w in work], [w.scratch for w in work])
            parts = [(w.seq, w.end - 1, w.end, self._ids(w.seq, w.end - 1, w.end), w.scratch) for w in work]
            drafts[:, 0] = self._pick(self._forward(parts), work, probs, slots, 0)
        for step in range(1, work[0].k):  # decode: draft `step` in, draft `step + 1` out
            m = sum(w.k > step for w in work)
            parts = [(w.seq, w.end + step - 1, w.end + step, None, w.scratch) for w in work[:m]]
            logits = self._forward(parts, _OnDevice(drafts[:m, step - 1]))
            drafts[:m, step] = self._pick(logits, work[:m], probs, slots, step)
        host = drafts.tolist()  # the call's one host sync
        return [row[:w.k] if w.params is None else SampledDraft(row[:w.k], probs[slots[w.index], :w.k], w.draw)
                for row, w in zip(host, work)]

    def _pick(self, logits: torch.Tensor, work: Sequence[_Work], probs: torch.Tensor | None,
              slots: dict[int, int], step: int) -> torch.Tensor:
        """The draft after each row of `logits` [S, vocab] (row s: `work[s]`'s): the argmax, or for
        a state with params q under the request's warpers, written to `probs` at (its slot, step),
        and a draw from it where the state draws. A request's logit_bias is added first, as the
        target adds it: a greedy request's drafts are then the ones it keeps."""
        requests = [w.request for w in work]
        if any(p is not None and p.logit_bias for p in requests):  # a greedy request's argmax moves too
            logits = apply_logit_bias(logits.float(), [p or _UNBIASED for p in requests])
        tokens = logits.argmax(dim=-1)
        with_q = [s for s, w in enumerate(work) if w.params is not None]
        if not with_q:
            return tokens
        rows = device_tensor(with_q, torch.long, self.device)
        params = [work[s].params for s in with_q]
        q = apply_warpers(logits.index_select(0, rows).float(), params).softmax(dim=-1)
        probs[device_tensor([slots[work[s].index] for s in with_q], torch.long, self.device), step] = q
        drawn = [j for j, s in enumerate(with_q) if work[s].draw]
        if not drawn:
            return tokens  # (a chosen draft is the argmax of q, as of the biased logits: the warpers keep it)
        at = device_tensor(drawn, torch.long, self.device)
        return tokens.index_copy(0, rows.index_select(0, at), draw(q.index_select(0, at), self.generator)[:, 0])

    def _ids(self, seq: KVSequence, start: int, end: int) -> list[int]:
        ids = seq.tokens[start:end]
        return ids if self._cap is None else [min(t, self._cap) for t in ids]

    @staticmethod
    def _live(w: _Work) -> int:
        """The slot a state's history runs in (a hybrid draft model's; -1 for others)."""
        return -1 if w.seq.recurrent is None else w.seq.recurrent.slot

    def _forward(self, parts: list[tuple[KVSequence, int, int, list[int] | None, int]],
                 previous: _OnDevice | None = None) -> torch.Tensor:
        """One batched forward of `parts` (seq, first position, end, ids (None: one token per
        part, from `previous`), a hybrid draft model's state slot), writing their KV (and states).
        Returns the logits after each part's last token [S, vocab] (the ids both models know)."""
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for seq, start, end, part_ids, _ in parts:
            ids.extend(part_ids if part_ids is not None else [0])
            positions.extend(seq.rope_positions(start, end))  # LongRoPE: its long rows
            slots.extend(seq.slot(p) for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + end - start)
            tables.append(seq.block_ids)  # its cache has one layer group
        from_device = [DeviceInput(i, i) for i in range(len(parts))] if previous is not None else []
        recurrent = {} if self.states is None else dict(state_slots=[p[4] for p in parts],
                                                         has_state=[p[1] > 0 for p in parts])
        data = StepData(ids=ids, positions=positions, slots=[slots], seq_lens=seq_lens, starts=starts,
                        tables=[tables], logits_indices=[s - 1 for s in starts[1:]],
                        max_query_len=max(e - s for _, s, e, *_ in parts), from_device=from_device, **recurrent)
        runner = self.runner
        self.counters.forwards += 1
        if runner.graphs is not None and runner.graphs.fits(data, len(parts)):
            logits, _ = runner.graphs.run(data, previous)  # [S, vocab]; whether it captured
        else:
            inputs = runner.prepare(data)
            runner.take_from_device(inputs.input_ids, data, previous)
            with self.ctx.forward_batch(inputs.batch):
                hidden = runner.model(inputs.input_ids, inputs.positions)  # [T, hidden]
            logits = runner.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab]
        return logits[:, :self.vocab_size]

    def summary(self) -> dict:
        c = self.counters
        return {"model": self.path, "calls": c.calls, "tokens_drafted": c.tokens_drafted,
                "tokens_prefilled": c.tokens_prefilled, "forwards": c.forwards,
                "seconds": round(c.seconds, 4),
                "ms_per_draft_token": round(1e3 * c.seconds / c.tokens_drafted, 3) if c.tokens_drafted else None,
                "kv_blocks": self.pool.num_blocks, "kv_blocks_used": self.pool.num_used,
                "states": len(self._states), "evictions": c.evictions, "skipped": c.skipped}

    def resident_bytes(self) -> int:
        """Device bytes this drafter holds: its own weights, its KV cache and a hybrid's state slots."""
        states = self.ctx.recurrent.nbytes if self.ctx.recurrent is not None else 0
        return self.weight_bytes + (self.kv_cache.nbytes if self.kv_cache is not None else 0) + states

    def close(self) -> None:
        """Free the weights and the KV (the engine closes); later proposals are empty."""
        for entry in self._states.values():
            entry.seq.release()
        self._states.clear()
        self.runner = self.kv_cache = self.ctx.kv_cache = self.ctx.recurrent = None
