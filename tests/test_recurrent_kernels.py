"""Gated DeltaNet kernel tests: the references against transformers' Qwen3.5 functions, run on each
sequence of a packed batch alone (mixed lengths, one across a 64-row chunk, fresh and continued
sequences, a sequence with no slot); a verify step (write=False) then its advance against a plain
step over the kept rows; then the Triton kernels against the references, in test_kernels'
interpreter worker (or compiled on CUDA)."""

from __future__ import annotations

import importlib

import pytest
import test_kernels
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (causal_conv1d_fn, causal_conv1d_update,
                                                          torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

import hibana_kernels
from hibana_kernels import recurrent

interpreter_worker, run_check = test_kernels.interpreter_worker, test_kernels.run_check  # its fixtures, reused
HK, HV, DK, DV = 2, 4, 16, 8  # grouped: each q/k head serves two v heads
CHANNELS, WIDTH = 24, 4
NUM_SLOTS = 8
# (rows, slot, has_state) per sequence: a single row (a decode) continued and fresh, rows across
# a 64-row chunk, a sequence with no slot, one with no rows
BATCH = ((5, 3, True), (1, 0, True), (70, 5, True), (2, 1, False), (3, -1, True), (1, 2, False),
         (0, 6, True), (66, 7, False))
SMALL_BATCH = ((2, 3, True), (1, 0, True), (5, 5, True), (3, 1, False), (2, -1, True), (0, 6, True),
               (9, 7, False))
"""For the interpreter, which runs every row of every program in Python."""
KEPT = (3, 1, 65, 2, 2, 0, 0, 40)
"""Rows of BATCH a verify step keeps: some, the single one, several across a chunk, all, none."""
SMALL_KEPT = (1, 1, 5, 2, 2, 0, 0)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
STATE_TOLERANCE = dict(atol=2e-5, rtol=2e-5)  # float32 states, whatever the rows' dtype


def layout(batch, device="cpu"):
    """(slots, has_state, query_start_loc) of a batch of (rows, slot, has_state)."""
    lens = torch.tensor([0] + [rows for rows, _, _ in batch])
    return (torch.tensor([slot for _, slot, _ in batch], dtype=torch.int32, device=device),
            torch.tensor([has for _, _, has in batch], dtype=torch.bool, device=device),
            lens.cumsum(0).to(device=device, dtype=torch.int32))


def conv_inputs(batch, dtype, device="cpu", seed=0, bias=True):
    """(x [T, C], weight [C, K], bias, conv_state [S, C, K-1]) in `dtype`, random."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(n for n, _, _ in batch)
    x = torch.randn(rows, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5
    b = torch.randn(CHANNELS, generator=gen) if bias else None
    state = torch.randn(NUM_SLOTS, CHANNELS, WIDTH - 1, generator=gen)
    return tuple(None if t is None else t.to(device=device, dtype=dtype) for t in (x, weight, b, state))


def delta_inputs(batch, dtype, device="cpu", seed=0):
    """(q, k, v, beta in `dtype` (a layer's beta is a sigmoid of its rows); g, state float32),
    random: decays mostly mild (exp(g) around 0.9), some strong."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(n for n, _, _ in batch)
    q, k = torch.randn(rows, HK, DK, generator=gen), torch.randn(rows, HK, DK, generator=gen)
    v = torch.randn(rows, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(rows, HV, generator=gen) * 2 - 2)
    beta = torch.rand(rows, HV, generator=gen)
    state = torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen) * 0.5
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device), beta.to(device, dtype),
            state.to(device))


def sequences(batch):
    """(rows slice, slot, has_state) of each sequence."""
    start = 0
    for rows, slot, has in batch:
        yield slice(start, start + rows), slot, has
        start += rows


def untouched_slots(batch):
    """Slots no sequence of the batch writes (unused, or its sequence has no rows)."""
    written = {slot for rows, slot, _ in batch if slot >= 0 and rows}
    return [s for s in range(NUM_SLOTS) if s not in written]


def _triton():
    """The Triton module, imported only where a check runs it (triton stays unimported here)."""
    return importlib.import_module("hibana_kernels.recurrent_triton")


# ---------------------------------------------------------------------------------------------
# the references against transformers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_transformers(dtype, bias, activation):
    """Each sequence as transformers runs it alone: `causal_conv1d_fn` for a fresh one (zero
    padding), `causal_conv1d_update` from its conv state otherwise (which also leaves the state):
    the same roundings, float32 sums perhaps in another order."""
    x, weight, b, state = conv_inputs(BATCH, dtype, bias=bias)
    before = state.clone()
    y = hibana_kernels.causal_conv1d(x, weight, b, state, *layout(BATCH), activation=activation)
    assert y.dtype == dtype
    for rows, slot, has in sequences(BATCH):
        if slot < 0:
            assert not y[rows].any()
            continue
        if rows.stop == rows.start:
            continue
        seq = x[rows].t()[None]  # [1, C, n]
        if has:
            expected_state = before[slot][None].clone()
            expected = causal_conv1d_update(seq, expected_state, weight, b, activation)
        else:
            expected = causal_conv1d_fn(seq, weight, b, activation)
            expected_state = F.pad(seq, (WIDTH - 1, 0))[..., -(WIDTH - 1):]
        torch.testing.assert_close(y[rows], expected[0].t(), **TOLERANCE[dtype])
        torch.testing.assert_close(state[slot], expected_state[0], atol=0, rtol=0)
    untouched = untouched_slots(BATCH)
    torch.testing.assert_close(state[untouched], before[untouched], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_delta_rule_matches_transformers(dtype):
    """Each sequence as transformers runs it alone with use_qk_l2norm_in_kernel: the chunked
    function for several rows, the recurrent one for a single row; outputs and final states."""
    q, k, v, g, beta, state = delta_inputs(BATCH, dtype)
    before = state.clone()
    o = hibana_kernels.gated_delta_rule(q, k, v, g, beta, state, *layout(BATCH))
    assert o.dtype == dtype and o.shape == v.shape
    for rows, slot, has in sequences(BATCH):
        if slot < 0:
            assert not o[rows].any()
            continue
        if rows.stop == rows.start:
            continue
        form = torch_recurrent_gated_delta_rule if rows.stop - rows.start == 1 else torch_chunk_gated_delta_rule
        expected, expected_state = form(q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows],
                                        initial_state=before[slot][None] if has else None,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        # bf16: the same float32 arithmetic in another order, a rounding apart at most
        torch.testing.assert_close(o[rows], expected[0], **TOLERANCE[dtype])
        torch.testing.assert_close(state[slot], expected_state[0], **STATE_TOLERANCE)
    untouched = untouched_slots(BATCH)
    torch.testing.assert_close(state[untouched], before[untouched], atol=0, rtol=0)


def kept_batch(batch, kept):
    """(the batch of each sequence's first kept rows, the index of those rows in the full batch)."""
    rows = [torch.arange(r.start, r.start + n) for (r, _, _), n in zip(sequences(batch), kept)]
    return tuple((n, slot, has) for (_, slot, has), n in zip(batch, kept)), torch.cat(rows)


def check_verify_then_advance(device, dtype, batch=BATCH, kept=KEPT, use_triton=False):
    """write=False leaves the states and gives write=True's outputs; the advance by `kept` rows
    then leaves what write=True over the kept rows alone would have left (the reference's, through
    the dispatchers, or with `use_triton` the Triton kernels')."""
    impl = _triton() if use_triton else hibana_kernels
    slots, has_state, qsl = layout(batch, device)
    counts = torch.tensor(kept, dtype=torch.int32, device=device)
    short, index = kept_batch(batch, kept)
    index = index.to(device)

    x, weight, b, conv_state = conv_inputs(batch, dtype, device)
    expected_state = conv_state.clone()
    expected = recurrent.causal_conv1d(x, weight, b, expected_state, slots, has_state, qsl)
    before = conv_state.clone()
    y = impl.causal_conv1d(x, weight, b, conv_state, slots, has_state, qsl, write=False)
    torch.testing.assert_close(y, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(conv_state, before, atol=0, rtol=0)
    impl.conv_advance(x, conv_state, slots, qsl, counts, has_state)
    recurrent.causal_conv1d(x[index], weight, b, before, *layout(short, device))
    torch.testing.assert_close(conv_state, before, atol=0, rtol=0)

    q, k, v, g, beta, state = delta_inputs(batch, dtype, device)
    expected_state = state.clone()
    expected = recurrent.gated_delta_rule(q, k, v, g, beta, expected_state, slots, has_state, qsl)
    before = state.clone()
    o = impl.gated_delta_rule(q, k, v, g, beta, state, slots, has_state, qsl, write=False)
    torch.testing.assert_close(o, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, before, atol=0, rtol=0)
    impl.gated_delta_advance(k, v, g, beta, state, slots, qsl, counts, has_state)
    recurrent.gated_delta_rule(q[index], k[index], v[index], g[index], beta[index], before, *layout(short, device))
    torch.testing.assert_close(state, before, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_then_advance(dtype):
    check_verify_then_advance("cpu", dtype)


def check_advance_without_has_state(device, use_triton=False):
    """has_state left out: every slot holds its sequence's state, as has_state all True."""
    impl = _triton() if use_triton else recurrent
    batch = tuple((rows, slot, True) for rows, slot, _ in SMALL_BATCH)
    slots, has_state, qsl = layout(batch, device)
    counts = torch.tensor(SMALL_KEPT, dtype=torch.int32, device=device)
    x, _, _, conv_state = conv_inputs(batch, torch.float32, device)
    expected = conv_state.clone()
    recurrent.conv_advance(x, expected, slots, qsl, counts, has_state)
    impl.conv_advance(x, conv_state, slots, qsl, counts)
    torch.testing.assert_close(conv_state, expected, atol=0, rtol=0)
    _, k, v, g, beta, state = delta_inputs(batch, torch.float32, device)
    expected = state.clone()
    recurrent.gated_delta_advance(k, v, g, beta, expected, slots, qsl, counts, has_state)
    impl.gated_delta_advance(k, v, g, beta, state, slots, qsl, counts)
    torch.testing.assert_close(state, expected, **STATE_TOLERANCE)


def test_advance_without_has_state():
    check_advance_without_has_state("cpu")


def test_activation_is_checked():
    x, weight, b, state = conv_inputs(SMALL_BATCH, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        recurrent.causal_conv1d(x, weight, b, state, *layout(SMALL_BATCH), activation="gelu")


# ---------------------------------------------------------------------------------------------
# Triton kernels against the references (each check runs in the interpreter worker or on CUDA)


def check_causal_conv1d(device, dtype, bias, activation, write):
    slots, has_state, qsl = layout(SMALL_BATCH, device)
    x, weight, b, state = conv_inputs(SMALL_BATCH, dtype, device, seed=1, bias=bias)
    expected_state = state.clone()
    expected = recurrent.causal_conv1d(x, weight, b, expected_state, slots, has_state, qsl, activation, write)
    y = _triton().causal_conv1d(x, weight, b, state, slots, has_state, qsl, activation, write)
    # bf16: two roundings (conv, activation), which the interpreter truncates: a unit off
    torch.testing.assert_close(y, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, atol=0, rtol=0)


def check_gated_delta_rule(device, dtype, write, strided):
    """strided: q, k, v views of one fused row, as a layer splits its convolution's output."""
    slots, has_state, qsl = layout(SMALL_BATCH, device)
    q, k, v, g, beta, state = delta_inputs(SMALL_BATCH, dtype, device, seed=2)
    if strided:
        fused = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
        q, k, v = (part.unflatten(1, shape) for part, shape in
                   zip(fused.split((HK * DK, HK * DK, HV * DV), dim=1), ((HK, DK), (HK, DK), (HV, DV))))
    expected_state = state.clone()
    expected = recurrent.gated_delta_rule(q, k, v, g, beta, expected_state, slots, has_state, qsl, write)
    o = _triton().gated_delta_rule(q, k, v, g, beta, state, slots, has_state, qsl, write)
    assert o.dtype == dtype and o.shape == v.shape
    torch.testing.assert_close(o, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias, activation, write", [(True, "silu", True), (False, None, False)],
                         ids=["bias-silu-write", "plain-nowrite"])
def test_triton_causal_conv1d(run_check, dtype, bias, activation, write):
    run_check(check_causal_conv1d, dtype=dtype, bias=bias, activation=activation, write=write)


@pytest.mark.parametrize("dtype, write, strided", [(torch.float32, True, False), (torch.bfloat16, True, True),
                                                   (torch.float32, False, True)],
                         ids=["float32", "bfloat16-strided", "float32-strided-nowrite"])
def test_triton_gated_delta_rule(run_check, dtype, write, strided):
    run_check(check_gated_delta_rule, dtype=dtype, write=write, strided=strided)


def test_triton_verify_then_advance(run_check):
    run_check(check_verify_then_advance, dtype=torch.float32, batch=SMALL_BATCH, kept=SMALL_KEPT, use_triton=True)


def test_triton_advance_without_has_state(run_check):
    run_check(check_advance_without_has_state, use_triton=True)
