"""Gated DeltaNet kernel tests: the references against transformers' Qwen3.5 functions, run on each
sequence of a packed batch alone (mixed lengths, one across a 64-row chunk, fresh and continued
sequences, a sequence with no slot); a verify step (write=False) then its advance against a plain
step over the kept rows; the layer's gates and gated RMSNorm against transformers' bit for bit;
then the Triton kernels against the references, in test_kernels' interpreter worker (or compiled
on CUDA): the token-by-token ones and the delta rule's chunked one (a prefill's)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import test_kernels
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5GatedDeltaNet, Qwen3_5RMSNormGated,
                                                          causal_conv1d_fn, causal_conv1d_update,
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
CHUNKED_BATCH = ((1, 0, True), (5, 3, True), (16, 5, True), (23, 1, False), (20, -1, True), (40, 7, True),
                 (0, 6, True), (37, 2, False))
"""For the chunked delta rule at 16 rows a chunk (its default): a single row, fewer than a chunk,
exactly one, across two and three chunks (continued and fresh), a sequence with no slot, one with
no rows."""
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
STATE_TOLERANCE = dict(atol=2e-5, rtol=2e-5)  # float32 states, whatever the rows' dtype
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
GATE_HEADS, NORM_DIM = 6, 24  # not powers of two: the kernels' masks


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


def strided_rows(x):
    """x's values in a view of wider rows (a fused projection's split): a row stride past its width."""
    wide = torch.full((x.shape[0], x.shape[1] + 8), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, 3:3 + x.shape[1]] = x
    return wide[:, 3:3 + x.shape[1]]


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


def gate_inputs(dtype, device="cpu", seed=3):
    """(a, b [T, GATE_HEADS]: views of one fused projection's rows, as a layer splits it; a_log,
    dt_bias [GATE_HEADS]) in `dtype`, random, a's first row across softplus's threshold (dt_bias 0
    there) and far below it, b's first row where the sigmoid saturates."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(37, 2 * GATE_HEADS, generator=gen) * 6  # [T, b | a]
    fused[0] = torch.tensor([-90.0, -30.0, -8.0, 0.0, 8.0, 30.0, -80.0, 19.875, 20.0, 20.125, 30.0, -3.0])
    a_log = torch.empty(GATE_HEADS).uniform_(0.01, 16, generator=gen).log()  # transformers' init
    dt_bias = torch.randn(GATE_HEADS, generator=gen)
    dt_bias[:5] = 0.0
    fused, a_log, dt_bias = (t.to(device, dtype) for t in (fused, a_log, dt_bias))
    b, a = fused.split(GATE_HEADS, dim=-1)
    return a, b, a_log, dt_bias


def norm_inputs(dtype, heads, device="cpu", seed=4):
    """(x, gate, weight): x [T, heads, D] (heads None: [T * 4, D]), gate of its shape a view of
    wider rows (as z's heads within the input projection's), weight [D] around 1, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    rows = 5 * 4
    x = torch.randn(rows, NORM_DIM, generator=gen) * 3
    wide = torch.randn(rows // (heads or 1), (heads or 1) * NORM_DIM + 7, generator=gen) * 3
    weight = 1 + torch.randn(NORM_DIM, generator=gen) * 0.3
    x, wide, weight = (t.to(device, dtype) for t in (x, wide, weight))
    gate = wide[:, 5:5 + (heads or 1) * NORM_DIM]
    if heads:
        x, gate = x.view(-1, heads, NORM_DIM), gate.unflatten(-1, (heads, NORM_DIM))
    return x, gate, weight


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The largest distance between the two in units in the last place of their dtype (the count
    of representable values between them; +0 and -0 are one)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if not actual.numel():
        return 0
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[actual.dtype]
    magnitude = torch.iinfo(bits).max

    def ordered(t):
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return int((ordered(actual) - ordered(expected)).abs().max())


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
        # each q/k head repeated for the v heads it serves, as the layer does before these functions in
        # transformers releases whose functions take equal head counts only (5.17, the GPU image's)
        group = v.shape[1] // q.shape[1]
        rq, rk = (x[rows].repeat_interleave(group, dim=1) for x in (q, k))
        expected, expected_state = form(rq[None], rk[None], v[None, rows], g[None, rows], beta[None, rows],
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
    """has_state left out: every slot holds its sequence's state, as has_state all True. (x
    strided: a layer's q/k/v rows, a view of its input projection's.)"""
    impl = _triton() if use_triton else recurrent
    batch = tuple((rows, slot, True) for rows, slot, _ in SMALL_BATCH)
    slots, has_state, qsl = layout(batch, device)
    counts = torch.tensor(SMALL_KEPT, dtype=torch.int32, device=device)
    x, _, _, conv_state = conv_inputs(batch, torch.float32, device)
    x = strided_rows(x)
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


def padded(batch, pads, tensor):
    """tensor's rows of `batch` with pads[b] rows of NaN in front of sequence b's (a CUDA graph's
    front padding, which the kernels must never read), and the padded batch."""
    parts, wider = [], []
    for (rows, slot, has), (index, _, _), pad in zip(batch, sequences(batch), pads):
        parts += [torch.full((pad, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype, device=tensor.device),
                  tensor[index]]
        wider.append((rows + pad, slot, has))
    return torch.cat(parts), tuple(wider)


def check_front_padding(device, dtype, batch, kept, use_triton=False):
    """A verify step whose sequences are front-padded (skip), writing its conv output and a copy
    of x into given buffers and its gates into given buffers, then its advance with skip: each
    the unpadded step's, the padding never read, the buffers' padding rows left as they were."""
    impl = _triton() if use_triton else recurrent
    pads = [(3 * i) % 4 for i in range(len(batch))]
    slots, has_state, qsl = layout(batch, device)
    skip = torch.tensor(pads, dtype=torch.int32, device=device)
    counts = torch.tensor(kept, dtype=torch.int32, device=device)
    x, weight, b, conv_state = conv_inputs(batch, dtype, device, seed=5)
    px, wide = padded(batch, pads, x)
    _, _, pqsl = layout(wide, device)
    own = ~px[:, 0].isnan()  # the padded batch's rows that are the sequences'
    expected_conv = conv_state.clone()
    want = recurrent.causal_conv1d(x, weight, b, expected_conv.clone(), slots, has_state, qsl, "silu", False)
    out, x_copy = torch.full_like(px, 7.0), torch.full_like(px, 9.0)
    y = impl.causal_conv1d(px, weight, b, conv_state, slots, has_state, pqsl, "silu", False, skip, out, x_copy)
    assert y.data_ptr() == out.data_ptr()
    live = own & torch.tensor([s >= 0 for (n, s, _), p in zip(batch, pads) for s in [s] * (n + p)], device=device)
    torch.testing.assert_close(out[live], want[torch.tensor([s >= 0 for n, s, _ in batch for _ in range(n)],
                                                             device=device)], **TOLERANCE[dtype])
    assert torch.equal(out[~own], torch.full_like(out[~own], 7.0))
    assert torch.equal(x_copy[live], px[live]) and torch.equal(x_copy[~own], torch.full_like(x_copy[~own], 9.0))
    torch.testing.assert_close(conv_state, expected_conv, atol=0, rtol=0)  # (write=False)
    impl.conv_advance(x_copy, conv_state, slots, pqsl, counts, has_state, skip)
    recurrent.conv_advance(x, expected_conv, slots, qsl, counts, has_state)
    torch.testing.assert_close(conv_state, expected_conv, atol=0, rtol=0)

    q, k, v, g, beta, state = delta_inputs(batch, dtype, device, seed=6)
    pq, pk, pv, pg, pbeta = (padded(batch, pads, t)[0] for t in (q, k, v, g, beta))
    expected = state.clone()
    want = recurrent.gated_delta_rule(q, k, v, g, beta, expected.clone(), slots, has_state, qsl, write=False)
    o = impl.gated_delta_rule(pq, pk, pv, pg, pbeta, state, slots, has_state, pqsl, write=False, skip=skip)
    torch.testing.assert_close(o[own], want, **TOLERANCE[dtype])
    assert not o[~own].any()  # zeros, as rows of no sequence
    torch.testing.assert_close(state, expected, atol=0, rtol=0)
    impl.gated_delta_advance(pk, pv, pg, pbeta, state, slots, pqsl, counts, has_state, skip)
    recurrent.gated_delta_advance(k, v, g, beta, expected, slots, qsl, counts, has_state)
    torch.testing.assert_close(state, expected, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_front_padded_verify_step_skips_its_padding(dtype):
    check_front_padding("cpu", dtype, BATCH, KEPT)


def test_gdn_gates_write_given_buffers():
    a, b, a_log, dt_bias = gate_inputs(torch.bfloat16)
    buffers = (torch.empty(a.shape, dtype=torch.float32), torch.empty(a.shape, dtype=torch.bfloat16))
    g, beta = hibana_kernels.gdn_gates(a, b, a_log, dt_bias, out=buffers)
    assert g is buffers[0] and beta is buffers[1]
    assert all(torch.equal(x, y) for x, y in zip((g, beta), recurrent.gdn_gates(a, b, a_log, dt_bias)))


def test_activation_is_checked():
    x, weight, b, state = conv_inputs(SMALL_BATCH, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        recurrent.causal_conv1d(x, weight, b, state, *layout(SMALL_BATCH), activation="gelu")


def test_gates_are_transformers_lines():
    """The reference's two lines are transformers' own (which a model's greedy output follows)."""
    source = inspect.getsource(Qwen3_5GatedDeltaNet.forward)
    assert "beta = b.sigmoid()" in source
    assert "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)" in source


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_gdn_gates_match_transformers(dtype):
    """Bit for bit, from strided views; g float32 whatever the model dtype, beta in b's."""
    a, b, a_log, dt_bias = gate_inputs(dtype)
    g, beta = hibana_kernels.gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    assert torch.equal(beta, b.sigmoid())
    assert torch.equal(g, -a_log.float().exp() * F.softplus(a.float() + dt_bias))
    assert g[0, 0] < 0  # softplus(-80): tiny, not 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_sigmoid_rounds_once(dtype):
    """What the Triton kernel computes: torch's sigmoid of a 16-bit float is the float32 sigmoid
    rounded once, and over every finite value that is 1 / (1 + exp(-x)) in float32 rounded once
    (the two float32 results, a few ulps apart at most, round alike)."""
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[x.isfinite()]
    assert torch.equal(x.sigmoid(), x.float().sigmoid().to(dtype))
    assert ulps_apart(x.sigmoid(), (1 / (1 + torch.exp(-x.float()))).to(dtype)) == 0


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("heads", [4, None], ids=["heads", "rows"])
def test_gated_rms_norm_matches_transformers(dtype, heads):
    """transformers' Qwen3_5RMSNormGated module, its weight in the model dtype: bit for bit."""
    x, gate, weight = norm_inputs(dtype, heads)
    module = Qwen3_5RMSNormGated(NORM_DIM, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x, gate)
    y = hibana_kernels.gated_rms_norm(x, gate, weight, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, expected)


# ---------------------------------------------------------------------------------------------
# Triton kernels against the references (each check runs in the interpreter worker or on CUDA)


def check_causal_conv1d(device, dtype, bias, activation, write, strided=False):
    """strided: x a view of wider rows, as a layer splits its input projection."""
    slots, has_state, qsl = layout(SMALL_BATCH, device)
    x, weight, b, state = conv_inputs(SMALL_BATCH, dtype, device, seed=1, bias=bias)
    if strided:
        x = strided_rows(x)
    expected_state = state.clone()
    expected = recurrent.causal_conv1d(x, weight, b, expected_state, slots, has_state, qsl, activation, write)
    y = _triton().causal_conv1d(x, weight, b, state, slots, has_state, qsl, activation, write)
    # bf16: two roundings (conv, activation), which the interpreter truncates: a unit off
    torch.testing.assert_close(y, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, atol=0, rtol=0)


def fused_rows(q, k, v):
    """q, k, v's values as views of one fused row, as a layer splits its convolution's output."""
    fused = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
    return (part.unflatten(1, shape) for part, shape in
            zip(fused.split((HK * DK, HK * DK, HV * DV), dim=1), ((HK, DK), (HK, DK), (HV, DV))))


def check_gated_delta_rule(device, dtype, write, strided):
    """strided: q, k, v views of one fused row (`fused_rows`)."""
    slots, has_state, qsl = layout(SMALL_BATCH, device)
    q, k, v, g, beta, state = delta_inputs(SMALL_BATCH, dtype, device, seed=2)
    if strided:
        q, k, v = fused_rows(q, k, v)
    expected_state = state.clone()
    expected = recurrent.gated_delta_rule(q, k, v, g, beta, expected_state, slots, has_state, qsl, write)
    o = _triton().gated_delta_rule(q, k, v, g, beta, state, slots, has_state, qsl, write)
    assert o.dtype == dtype and o.shape == v.shape
    torch.testing.assert_close(o, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias, activation, write, strided", [(True, "silu", True, True), (False, None, False, False)],
                         ids=["bias-silu-write-strided", "plain-nowrite"])
def test_triton_causal_conv1d(run_check, dtype, bias, activation, write, strided):
    run_check(check_causal_conv1d, dtype=dtype, bias=bias, activation=activation, write=write, strided=strided)


@pytest.mark.parametrize("dtype, write, strided", [(torch.float32, True, False), (torch.bfloat16, True, True),
                                                   (torch.float32, False, True)],
                         ids=["float32", "bfloat16-strided", "float32-strided-nowrite"])
def test_triton_gated_delta_rule(run_check, dtype, write, strided):
    run_check(check_gated_delta_rule, dtype=dtype, write=write, strided=strided)


def check_chunked_delta_rule(device, dtype, write=True, strided=False, padding=False, tiles=None):
    """The chunked kernel over CHUNKED_BATCH against the reference. strided: q, k, v views of one
    fused row; padding: rows of NaN in front of each sequence's, left out by `skip` (zeros in the
    output); tiles: (chunk, block_dv, num_warps, num_stages), else its default."""
    impl = _triton()
    tiles = impl.CHUNK_TILES if tiles is None else impl.ChunkTiles(*tiles)
    slots, has_state, qsl = layout(CHUNKED_BATCH, device)
    q, k, v, g, beta, state = delta_inputs(CHUNKED_BATCH, dtype, device, seed=7)
    expected_state = state.clone()
    expected = recurrent.gated_delta_rule(q, k, v, g, beta, expected_state, slots, has_state, qsl, write)
    skip = None
    if padding:
        pads = [(3 * i) % 4 for i in range(len(CHUNKED_BATCH))]
        skip = torch.tensor(pads, dtype=torch.int32, device=device)
        _, _, qsl = layout(padded(CHUNKED_BATCH, pads, g)[1], device)
        q, k, v, g, beta = (padded(CHUNKED_BATCH, pads, t)[0] for t in (q, k, v, g, beta))
    if strided:
        q, k, v = fused_rows(q, k, v)
    o = impl.chunked_delta_rule(q, k, v, g, beta, state, slots, has_state, qsl, write, skip, tiles)
    assert o.dtype == dtype and o.shape == v.shape
    own = ~g[:, 0].isnan()  # the rows that are the sequences' (all but the padding)
    torch.testing.assert_close(o[own], expected, **TOLERANCE[dtype])
    assert not o[~own].any()  # zeros, as rows of no sequence
    torch.testing.assert_close(state, expected_state, **STATE_TOLERANCE)


@pytest.mark.parametrize("dtype, write, strided, padding, tiles",
                         [(torch.float32, True, False, False, None), (torch.bfloat16, True, True, False, None),
                          (torch.float32, False, True, False, None), (torch.bfloat16, False, False, True, None),
                          (torch.float32, True, False, True, (32, 16, 4, 1))],
                         ids=["float32", "bfloat16-strided", "float32-strided-nowrite", "bfloat16-padded-nowrite",
                              "float32-padded-chunk32"])
def test_triton_chunked_delta_rule(run_check, dtype, write, strided, padding, tiles):
    run_check(check_chunked_delta_rule, dtype=dtype, write=write, strided=strided, padding=padding, tiles=tiles)


def check_delta_rule_form_by_rows(device):
    """gated_delta_rule's max_rows picks the form: from CHUNKED_MIN_ROWS the chunked kernel, below
    it (or None) the token-by-token one, outputs and states bit for bit (the two forms round
    apart here, so the check tells them apart)."""
    impl = _triton()
    slots, has_state, qsl = layout(SMALL_BATCH, device)
    q, k, v, g, beta, state = delta_inputs(SMALL_BATCH, torch.float32, device, seed=8)

    def run(fn, **options):
        out_state = state.clone()
        return fn(q, k, v, g, beta, out_state, slots, has_state, qsl, **options), out_state

    chunked, token = run(impl.chunked_delta_rule), run(impl.gated_delta_rule)
    assert not torch.equal(chunked[1], token[1])
    default = impl.CHUNKED_MIN_ROWS  # (64 unless HIBANA_CHUNKED_DELTA=0 turns the chunked form off)
    try:
        impl.CHUNKED_MIN_ROWS = 64
        for max_rows, want in ((64, chunked), (63, token)):
            got = run(impl.gated_delta_rule, max_rows=max_rows)
            assert all(torch.equal(x, y) for x, y in zip(got, want)), max_rows
        impl.CHUNKED_MIN_ROWS = None  # off: token by token however many rows
        assert all(torch.equal(x, y) for x, y in zip(run(impl.gated_delta_rule, max_rows=4096), token))
    finally:
        impl.CHUNKED_MIN_ROWS = default


def test_triton_delta_rule_form_by_rows(run_check):
    run_check(check_delta_rule_form_by_rows)


def test_triton_verify_then_advance(run_check):
    run_check(check_verify_then_advance, dtype=torch.float32, batch=SMALL_BATCH, kept=SMALL_KEPT, use_triton=True)


def test_triton_advance_without_has_state(run_check):
    run_check(check_advance_without_has_state, use_triton=True)



def test_triton_front_padded_verify_step(run_check):
    run_check(check_front_padding, dtype=torch.float32, batch=SMALL_BATCH, kept=SMALL_KEPT, use_triton=True)


def check_gdn_gates_into_buffers(device):
    a, b, a_log, dt_bias = gate_inputs(torch.float32, device)
    buffers = (torch.full(a.shape, 5.0, device=device), torch.full(a.shape, 5.0, device=device))
    g, beta = _triton().gdn_gates(a, b, a_log, dt_bias, out=buffers)
    assert g is buffers[0] and beta is buffers[1]
    expected_g, expected_beta = _triton().gdn_gates(a, b, a_log, dt_bias)
    assert torch.equal(g, expected_g) and torch.equal(beta, expected_beta)


def test_triton_gdn_gates_into_buffers(run_check):
    run_check(check_gdn_gates_into_buffers)


GATES_ULPS = {torch.float32: 4, torch.bfloat16: 1, torch.float16: 1}
"""beta's distance from the reference in the interpreter: numpy's exp against torch's, and its
bf16 casts truncate. g (float32) is within 8: exp and log1p a few ulps apart."""
NORM_ULPS = {torch.float32: 8, torch.bfloat16: 6, torch.float16: 2}
"""The gated norm's distance, interpreter or CUDA: the float32 statistic summed in another order;
in the interpreter its three bf16 roundings truncate."""


def check_gdn_gates(device, dtype):
    """Compiled on CUDA (libdevice's exp and log1p, torch's own): g bit for bit, beta within one
    ulp (on the H100, 2026-12-07, a float32 sigmoid came out one ulp from torch's: its kernel
    divides in another order); in the interpreter within a few ulps."""
    a, b, a_log, dt_bias = gate_inputs(dtype, device)
    g, beta = _triton().gdn_gates(a, b, a_log, dt_bias)
    expected_g, expected_beta = recurrent.gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    exact = device == "cuda"
    assert ulps_apart(g, expected_g) <= (0 if exact else 8)
    assert ulps_apart(beta, expected_beta) <= (1 if exact else GATES_ULPS[dtype])
    g, beta = _triton().gdn_gates(a[:0], b[:0], a_log, dt_bias)
    assert g.shape == beta.shape == (0, GATE_HEADS)


def check_gated_rms_norm(device, dtype, heads, float32_weight):
    """float32_weight: the product weight * normed not rounded (torch's promotion)."""
    x, gate, weight = norm_inputs(dtype, heads, device)
    if float32_weight:
        weight = weight.float()
    y = _triton().gated_rms_norm(x, gate, weight, 1e-6)
    expected = recurrent.gated_rms_norm(x, gate, weight, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert ulps_apart(y, expected) <= NORM_ULPS[dtype]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_triton_gdn_gates(run_check, dtype):
    run_check(check_gdn_gates, dtype=dtype)


@pytest.mark.parametrize("dtype, heads, float32_weight",
                         [(torch.float32, 4, False), (torch.bfloat16, 4, False), (torch.float16, None, False),
                          (torch.bfloat16, None, True)],
                         ids=["float32-heads", "bfloat16-heads", "float16-rows", "bfloat16-float32-weight"])
def test_triton_gated_rms_norm(run_check, dtype, heads, float32_weight):
    run_check(check_gated_rms_norm, dtype=dtype, heads=heads, float32_weight=float32_weight)
