"""Kernel tests: the attention references against naive dense attention, and every Triton kernel
against its torch reference on random inputs.

The Triton checks run under Triton's interpreter on CPU tensors, in one worker process: the
interpreter is switched on by TRITON_INTERPRET=1, which must be set before triton is first
imported, something this process cannot promise when the whole suite runs in it (and the
variable would leak into other tests). With a GPU, the same checks also run compiled, in-process.
Shapes are small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
import unittest.mock
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import hibana_kernels as kernels
from hibana_kernels import activation, attention, counters, fusion, matmul, norm, quant, rotary

BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_KV_HEADS = 2
HAS_TRITON = importlib.util.find_spec("triton") is not None  # triton itself stays unimported here
DEVICES = [
    pytest.param("interpreter", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (HAS_TRITON and torch.cuda.is_available()), reason="no CUDA device")),
]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# (seq_len, query_len) per sequence: odd lengths, lengths at and across block boundaries, a
# one-token prompt, chunks starting mid-block, a chunk of several query tiles, a verify-like
# chunk of 4, long decodes (several splits)
DECODE_BATCH = ((1, 1), (15, 1), (16, 1), (17, 1), (33, 1), (150, 1))
MIXED_BATCH = ((1, 1), (16, 16), (37, 5), (33, 1), (80, 70), (45, 4), (150, 1))
# a verify step of speculation in a CUDA graph: every sequence has the same few new tokens
VERIFY_BATCH = ((5, 5), (15, 5), (16, 5), (21, 5), (40, 5), (150, 5))
MIXED_SHORT_BATCH = ((3, 3), (1, 1), (40, 17), (60, 33), (34, 2), (150, 32), (20, 0), (9, 9))
"""Short queries of several lengths (fresh prompts shorter than the longest too), one long, one
sequence with no new token: the CPU reference batches the short ones."""
WINDOW = 20
LONG_DECODE_BATCH = ((300, 1), (150, 1), (70, 1), (9, 1))
LONG_WINDOW = 100
"""With LONG_WINDOW, decodes whose window spans several key tiles: split decode gives keys to
more than one split (and the first to the sink tokens too)."""


def _exact(device, dtype):
    """Bit-exact, but the interpreter casts float32 to bfloat16 by truncation (compiled Triton,
    like torch, rounds to nearest even), so there bf16 results may differ by one unit."""
    if device == "cpu" and dtype == torch.bfloat16:
        return TOLERANCE[dtype]
    return dict(atol=0, rtol=0)


def thinned(argnames, keep, *axes):
    """pytest.mark.parametrize(argnames) over the product of `axes`, each a list of values, of
    tuples of several, or of pytest.params (several values under one id); a combination whose
    indices along the axes `keep` rejects is marked slow. The interpreter runs each program in
    Python: the default run takes the kept subset (each use says what it still covers), and
    `-m slow` the rest of the product; compiled on a GPU every case runs (`-m "not slow or thinned"`,
    bench/run_h200.sh's kernel_pytest)."""
    names = [name.strip() for name in argnames.split(",")]
    params = []
    for combo in itertools.product(*(list(enumerate(axis)) for axis in axes)):
        values, ids, marks = [], [], [] if keep(*(index for index, _ in combo)) else [pytest.mark.slow,
                                                                                     pytest.mark.thinned]
        for index, value in combo:
            if isinstance(value, type(pytest.param(None))):
                values += value.values
                ids.append(value.id)
                marks += value.marks
                continue
            for v in value if isinstance(value, tuple) else (value,):  # ids as pytest makes them
                plain = v is None or isinstance(v, (bool, int, float, str, torch.dtype))
                ids.append(str(v) if plain else f"{names[len(values)]}{index}")
                values.append(v)
        params.append(pytest.param(*values, id="-".join(ids), marks=marks))
    return pytest.mark.parametrize(argnames, params)


# ---------------------------------------------------------------------------------------------
# inputs


def fp8_scales(num_kv_heads, gen):
    """kv_scale [2, H_kv] of powers of two (what kv8 calibrates): 2^-7 .. 2^-3, so values of
    standard deviation 1 use the fp8 range, and some of the smaller scales' heads saturate."""
    return 2.0 ** -torch.randint(3, 8, (2, num_kv_heads), generator=gen).float()


def fp8_nan_cache(shape, device="cpu"):
    """An fp8 cache whose every byte is NaN (0x7f), as make_paged_batch's float caches are."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(attention.FP8)


def make_paged_batch(lens, num_heads, num_kv_heads, dtype, device, seed, head_dim=HEAD_DIM,
                     kv_fp8=False):
    """Random dense K/V per sequence, scattered into a NaN-filled paged cache through shuffled
    block tables (NaN: a kernel that reads a slot it should not makes the output NaN). kv_fp8:
    the cache holds them as fp8 (the batch carries its `kv_scale`; the dense K/V returned are
    what the cache reads back as)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / BLOCK_SIZE) for s, _ in lens) + 3
    width = max(math.ceil(s / BLOCK_SIZE) for s, _ in lens) + 1  # one column of padding
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_scale = fp8_scales(num_kv_heads, gen) if kv_fp8 else None
    k_cache = fp8_nan_cache(shape) if kv_fp8 else torch.full(shape, float("nan"), dtype=dtype)
    v_cache = fp8_nan_cache(shape) if kv_fp8 else torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense_k, dense_v = [], [], []
    for seq_len, _ in lens:
        blocks = [perm.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        tables.append(blocks + [0] * (width - len(blocks)))
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(seq_len)])
        attention.store_kv(k, v, k_cache, v_cache, slots, kv_scale)
        if kv_fp8:
            k = attention.dequantize_kv(attention.quantize_kv(k, kv_scale[0]), kv_scale[0], dtype)
            v = attention.dequantize_kv(attention.quantize_kv(v, kv_scale[1]), kv_scale[1], dtype)
        dense_k.append(k)
        dense_v.append(v)
    starts = [0]
    for _, query_len in lens:
        starts.append(starts[-1] + query_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=device)
    batch = dict(
        q=q.to(**to), k_cache=k_cache.to(**to), v_cache=v_cache.to(**to),
        block_tables=torch.tensor(tables, dtype=torch.int32, **to),
        seq_lens=torch.tensor([s for s, _ in lens], dtype=torch.int32, **to),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, **to),
        max_query_len=max(n for _, n in lens), max_seq_len=max(s for s, _ in lens),
    )
    if kv_fp8:
        batch["kv_scale"] = kv_scale.to(**to)
    return batch, dense_k, dense_v


def poison_gap(batch, lens, window, sink_tokens):
    """NaN into the cache slots no query of the step may read: those of each sequence between its
    first `sink_tokens` and the window of its first query (a "sink + window" layer's freed blocks)."""
    block_size = batch["k_cache"].shape[1]
    tables = batch["block_tables"].cpu()
    slots = [int(tables[i, j // block_size]) * block_size + j % block_size
             for i, (seq_len, query_len) in enumerate(lens)
             for j in range(sink_tokens, seq_len - query_len - window + 1)]
    slots = torch.tensor(slots, dtype=torch.long, device=batch["k_cache"].device)
    for name in ("k_cache", "v_cache"):
        rows = batch[name].flatten(0, 1)
        if rows.dtype == attention.FP8:
            rows.view(torch.uint8)[slots] = 0x7F
        else:
            rows[slots] = float("nan")
    return len(slots)


def naive_attention(q, dense_k, dense_v, lens, scale, window, sinks=None, sink_tokens=0):
    """Per query row, softmax over the visible keys of its sequence, in float64; `sinks` [H]:
    one more logit per head in each row's softmax, whose share is dropped; `sink_tokens`: with
    a window, the first keys stay visible."""
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    group = q.shape[1] // dense_k[0].shape[1]
    for (seq_len, query_len), k, v in zip(lens, dense_k, dense_v):
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        for p in range(seq_len - query_len, seq_len):
            j = torch.arange(seq_len)
            visible = (j <= p) & (((p - j < window) | (j < sink_tokens)) if window else True)
            s = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            s = s.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                s = torch.cat((s, sinks.double()[:, None]), dim=-1)
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1)[:, :seq_len], v)
            row += 1
    return out


# ---------------------------------------------------------------------------------------------
# the references against naive dense attention


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("lens", [DECODE_BATCH, MIXED_BATCH, VERIFY_BATCH, MIXED_SHORT_BATCH],
                         ids=["decode", "mixed", "verify", "mixed_short"])
def test_reference_attention_matches_dense(group, window, lens):
    batch, dense_k, dense_v = make_paged_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS,
                                               torch.float32, "cpu", seed=group)
    scale = HEAD_DIM ** -0.5
    expected = naive_attention(batch["q"], dense_k, dense_v, lens, scale, window)
    out = attention.paged_attention(**batch, scale=scale, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    host = attention.paged_attention_host(
        batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
        batch["seq_lens"].tolist(), batch["query_start_loc"].tolist(), scale, window)
    torch.testing.assert_close(host, out, atol=0, rtol=0)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("lens", [DECODE_BATCH, MIXED_BATCH, VERIFY_BATCH, MIXED_SHORT_BATCH],
                         ids=["decode", "mixed", "verify", "mixed_short"])
def test_reference_attention_sinks_join_the_softmax_denominator(group, window, lens):
    """gpt-oss's sinks: a per-head logit in every row's softmax, with no value; large sinks take
    most of the weight, so the outputs differ from attention without them."""
    batch, dense_k, dense_v = make_paged_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS,
                                               torch.float32, "cpu", seed=11 + group)
    scale = HEAD_DIM ** -0.5
    sinks = torch.linspace(-2.0, 3.0, group * NUM_KV_HEADS)
    expected = naive_attention(batch["q"], dense_k, dense_v, lens, scale, window, sinks)
    out = attention.paged_attention(**batch, scale=scale, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    plain = attention.paged_attention(**batch, scale=scale, sliding_window=window)
    assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("sink_tokens", [0, 1, 4, 20, 25, 1000])
@pytest.mark.parametrize("lens, window", [(DECODE_BATCH, WINDOW), (MIXED_BATCH, WINDOW), (VERIFY_BATCH, WINDOW),
                                          (MIXED_SHORT_BATCH, WINDOW), (LONG_DECODE_BATCH, LONG_WINDOW)],
                         ids=["decode", "mixed", "verify", "mixed_short", "long_decode"])
def test_reference_sink_tokens_stay_visible(sink_tokens, lens, window):
    """StreamingLLM's sink tokens: with a window, the first keys stay visible to every later
    query (without one, nothing changes); the slots between them and the window are never
    needed: NaN there changes no output, with or without gpt-oss's sinks, in an fp8 cache too."""
    batch, dense_k, dense_v = make_paged_batch(lens, 2 * NUM_KV_HEADS, NUM_KV_HEADS,
                                               torch.float32, "cpu", seed=13)
    scale = HEAD_DIM ** -0.5
    sinks = torch.linspace(-2.0, 3.0, 2 * NUM_KV_HEADS)
    expected = naive_attention(batch["q"], dense_k, dense_v, lens, scale, window, None, sink_tokens)
    out = attention.paged_attention(**batch, scale=scale, sliding_window=window, sink_tokens=sink_tokens)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention.paged_attention(**batch, scale=scale, sink_tokens=sink_tokens),
                               attention.paged_attention(**batch, scale=scale), atol=0, rtol=0)
    with_sinks = attention.paged_attention(**batch, scale=scale, sliding_window=window, sinks=sinks,
                                           sink_tokens=sink_tokens)
    torch.testing.assert_close(with_sinks.double(), naive_attention(
        batch["q"], dense_k, dense_v, lens, scale, window, sinks, sink_tokens), atol=1e-5, rtol=1e-5)
    fp8, _, _ = make_paged_batch(lens, 2 * NUM_KV_HEADS, NUM_KV_HEADS, torch.float32, "cpu", seed=13,
                                 kv_fp8=True)
    fp8_out = attention.paged_attention(**fp8, scale=scale, sliding_window=window, sink_tokens=sink_tokens)
    if poison_gap(batch, lens, window, sink_tokens) + poison_gap(fp8, lens, window, sink_tokens) == 0:
        return  # every key of the step is a sink or in a window
    torch.testing.assert_close(attention.paged_attention(
        **batch, scale=scale, sliding_window=window, sink_tokens=sink_tokens), out, atol=0, rtol=0)
    torch.testing.assert_close(attention.paged_attention(
        **batch, scale=scale, sliding_window=window, sinks=sinks, sink_tokens=sink_tokens), with_sinks,
        atol=0, rtol=0)
    torch.testing.assert_close(attention.paged_attention(
        **fp8, scale=scale, sliding_window=window, sink_tokens=sink_tokens), fp8_out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lens", [MIXED_BATCH, MIXED_SHORT_BATCH], ids=["mixed", "mixed_short"])
def test_reference_fp8_cache_reads_back_its_dequantized_values(dtype, lens):
    """An fp8 cache attends exactly as a cache of its dequantized values in the activations'
    dtype (the power-of-two scales make them exact there), for long and short queries alike;
    and close to dense attention over the unquantized K/V."""
    window = WINDOW if dtype == torch.float32 else None
    batch, dense_k, dense_v = make_paged_batch(lens, 4 * NUM_KV_HEADS, NUM_KV_HEADS, dtype, "cpu",
                                               seed=5, kv_fp8=True)
    assert batch["k_cache"].dtype == attention.FP8 and batch["k_cache"].element_size() == 1
    scale = HEAD_DIM ** -0.5
    out = attention.paged_attention(**batch, scale=scale, sliding_window=window)
    assert not out.isnan().any(), "read an unwritten cache slot"
    twin = dict(batch)
    kv_scale = twin.pop("kv_scale")
    for name, row in (("k_cache", 0), ("v_cache", 1)):
        twin[name] = attention.dequantize_kv(batch[name], kv_scale[row], dtype)  # NaN bytes stay NaN
    torch.testing.assert_close(out, attention.paged_attention(**twin, scale=scale, sliding_window=window),
                               atol=0, rtol=0)
    expected = naive_attention(batch["q"], dense_k, dense_v, lens, scale, window)
    torch.testing.assert_close(out.double(), expected, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                                            else TOLERANCE[dtype]))


def test_reference_fp8_quantization_saturates_and_rounds_to_nearest_even():
    scale = torch.tensor([0.5, 2.0 ** -6])
    x = torch.tensor([[[1.0, -300.0, 1e9, float("inf")], [2.0 ** -16, 1.5 * 2.0 ** -15, -7.0, 0.0]]])  # [1, 2, 4]
    q = attention.quantize_kv(x, scale)
    assert q.dtype == attention.FP8
    back = attention.dequantize_kv(q, scale, torch.float32)
    # head 0: 448 * 0.5 = 224 is its largest value, and what anything larger becomes
    assert back[0, 0].tolist() == [1.0, -224.0, 224.0, 224.0]
    # head 1, in units of its scale: 2^-10 lies halfway between 0 and the smallest subnormal
    # 2^-9 (to even: 0); 1.5 * 2^-9 halfway between 2^-9 and 2^-8 (to even: 2^-8); -448 exact
    assert back[0, 1].tolist() == [0.0, 2.0 ** -14, -7.0, 0.0]


def test_reference_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    v_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    k, v = torch.ones(3, 1, 4), 2 * torch.ones(3, 1, 4)
    attention.store_kv(k, v, k_cache, v_cache, torch.tensor([17, -1, 3]))
    assert k_cache.view(-1, 4).sum(-1).nonzero().flatten().tolist() == [3, 17]
    assert v_cache.view(-1, 4)[17].tolist() == [2.0] * 4


def make_quant_weight(bits, n, k, group_size, gen):
    """A random packed weight (qweight, scales, zeros or None) whose dequantized entries have
    standard deviation about 1/sqrt(k), so outputs stay near 1 for any k."""
    if bits == 8:
        qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = (0.5 + torch.rand(n, generator=gen)) / (73 * k ** 0.5)  # codes' std: 73
        return qweight, scales, None
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = ((0.5 + torch.rand(n, k // group_size, generator=gen)) / (4.6 * k ** 0.5)).half()
    zeros = (7.5 + 2 * torch.randn(n, k // group_size, generator=gen)).half()  # fractional
    return quant.pack_int4(codes), scales, zeros


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_reference_int4_round_trip(group_size):
    """pack/unpack are inverse, the packed byte holds k even in the low nibble, and linear_int4
    is F.linear on the dequantized weight (w = (code - zero) * scale per group along K);
    linear_int8 likewise (w = code * scale per output channel, the product in float32)."""
    gen = torch.Generator().manual_seed(group_size)
    n, k = 5, 3 * group_size
    codes = torch.randint(0, 16, (n, k), generator=gen)
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert packed[0, 0].item() == codes[0, 0].item() | codes[0, 1].item() << 4
    assert torch.equal(quant.unpack_int4(packed), codes.to(torch.uint8))
    _, scales, zeros = make_quant_weight(4, n, k, group_size, gen)
    w = quant.dequantize_int4(packed, scales, zeros, group_size, torch.float64)
    by_element = [[(codes[i, j] - zeros[i, j // group_size].double())
                   * scales[i, j // group_size].double() for j in range(k)] for i in range(n)]
    torch.testing.assert_close(w, torch.tensor(by_element, dtype=torch.float64), atol=0, rtol=0)
    x = torch.randn(3, 2, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(n, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(quant.linear_int4(x, packed, scales, zeros, group_size, bias),
                               F.linear(x, w, bias), atol=0, rtol=0)
    qweight, scales8, _ = make_quant_weight(8, n, k, group_size, gen)
    torch.testing.assert_close(quant.linear_int8(x, qweight, scales8, bias),
                               F.linear(x, (qweight * scales8[:, None]).double(), bias),
                               atol=0, rtol=0)


def make_fp8_weight(n, k, block, gen):
    """A random e4m3 weight [N, K] (every finite code but NaN's, subnormals included) and float32
    scales [ceil(N / bn), ceil(K / bk)], dequantized entries of standard deviation ~1/sqrt(k)."""
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # 0x7F / 0xFF are e4m3fn's NaNs: no checkpoint holds them
    qweight = codes.view(torch.float8_e4m3fn)
    blocks = (-(-n // block[0]), -(-k // block[1]))
    scales = (0.5 + torch.rand(blocks, generator=gen)) / (110 * k ** 0.5)  # codes' std: ~110
    return qweight, scales


def test_reference_fp8_dequantizes_block_by_block():
    """dequantize_fp8 is code * scale[n // bn, k // bk] element by element (partial last blocks
    included), in float32, and linear_fp8 is F.linear on it."""
    gen = torch.Generator().manual_seed(8)
    for n, k, block in [(7, 10, (3, 4)), (6, 16, (1, 16)), (5, 9, (5, 9)), (4, 12, (128, 128))]:
        qweight, scales = make_fp8_weight(n, k, block, gen)
        w = quant.dequantize_fp8(qweight, scales, block, torch.float64)
        by_element = [[(qweight[i, j].float() * scales[i // block[0], j // block[1]]).item() for j in range(k)]
                      for i in range(n)]
        torch.testing.assert_close(w, torch.tensor(by_element, dtype=torch.float32).double(), atol=0, rtol=0)
        x = torch.randn(3, k, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(quant.linear_fp8(x, qweight, scales, block), F.linear(x, w), atol=0, rtol=0)


def test_dispatch_on_cpu_runs_the_references_without_importing_triton():
    """`kernels` imports and runs on the CPU with triton never imported."""
    script = textwrap.dedent("""
        import sys, torch
        import hibana_kernels as kernels
        x = torch.randn(3, 8)
        kernels.rms_norm(x, torch.ones(8), 1e-6)
        kernels.fused_add_rms_norm(x, x, torch.ones(8), 1e-6)
        kernels.silu_and_mul(x)
        kernels.rms_norm_linear(x, x, torch.ones(8), 1e-6, torch.randn(5, 8))
        kernels.silu_and_mul_linear(x, torch.randn(5, 4))
        table = torch.randn(8, 4)
        kernels.rotary_embedding(torch.arange(3), x.view(3, 2, 4), x.view(3, 2, 4), table, table)
        cache = torch.zeros(2, 16, 1, 4)
        kernels.store_kv(x.view(3, 2, 4)[:, :1], x.view(3, 2, 4)[:, 1:], cache, cache.clone(),
                         torch.tensor([0, 1, 2]))
        kernels.paged_attention(x.view(3, 2, 4), cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32),
                                torch.tensor([0, 3], dtype=torch.int32), 3, 3, 0.5, None)
        kernels.linear_int8(x, torch.ones(5, 8, dtype=torch.int8), torch.ones(5))
        kernels.linear_int4(x, torch.zeros(5, 4, dtype=torch.uint8), torch.ones(5, 1).half(),
                            torch.zeros(5, 1).half(), 8)
        kernels.linear_fp8(x, torch.ones(5, 8).to(torch.float8_e4m3fn), torch.ones(1, 1), (5, 8))
        assert "triton" not in sys.modules, "the CPU path imported triton"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(kernels.__file__))))


# ---------------------------------------------------------------------------------------------
# Triton kernels against the references. Each check_* runs either in the interpreter worker (CPU
# tensors) or here on CUDA tensors; it raises on a mismatch.


def _triton_module(name):
    return importlib.import_module(f"hibana_kernels.{name}_triton")


def _poisoned_empty(empty):
    """torch.empty whose tensors hold NaN (integers: -2**30): a kernel that reads what nobody
    wrote gives NaN or a wild index."""
    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -(2 ** 30))
    return poisoned


def check_paged_attention(device, group, window, lens, dtype, num_splits, head_dim=HEAD_DIM,
                          bounds_slack=0, merge=None, kv_fp8=False, sinks=False, sink_tokens=0, poison=False):
    """bounds_slack: pass max_query_len and max_seq_len overstated by this much (CUDA graphs).
    merge: split decode merges in its own launch (True; a verify step of more rows than one
    program merges still takes `_reduce_splits_kernel`) or in that second launch (False). A
    launch merging in-kernel runs twice, as graph replays do: the counters it left must be zero.
    kv_fp8: an fp8 cache with its scales. sinks: per-head attention sinks (gpt-oss).
    sink_tokens: the first keys stay visible past the window; the slots between them and the
    window then hold NaN (`poison_gap`), and the reference must give the same output. poison:
    the launch's own buffers (the splits' partials) start as NaN."""
    triton_attention = _triton_module("attention")
    batch, _, _ = make_paged_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, dtype, device,
                                   seed=7 * group + len(lens), head_dim=head_dim, kv_fp8=kv_fp8)
    if sinks:
        batch["sinks"] = torch.linspace(-2.0, 3.0, group * NUM_KV_HEADS).to(dtype).to(device)
    scale = head_dim ** -0.5
    expected = attention.paged_attention(**batch, scale=scale, sliding_window=window, sink_tokens=sink_tokens)
    if sink_tokens and window and poison_gap(batch, lens, window, sink_tokens):
        torch.testing.assert_close(attention.paged_attention(
            **batch, scale=scale, sliding_window=window, sink_tokens=sink_tokens), expected, atol=0, rtol=0)
    if bounds_slack and batch["max_query_len"] > 1:
        batch["max_query_len"] += bounds_slack
    batch["max_seq_len"] += bounds_slack
    uniform = len({n for _, n in lens}) == 1 and lens[0][1] > 1  # the decode kernel's verify mode
    if num_splits is None:  # the public entry point, choosing its own splits
        out = triton_attention.paged_attention(**batch, scale=scale, sliding_window=window,
                                               uniform_query_len=uniform, sink_tokens=sink_tokens)
    else:
        args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
                batch["seq_lens"], batch["query_start_loc"], batch["max_query_len"], scale, window,
                num_splits)
        kwargs = dict(decode=uniform or None, merge=merge, kv_scale=batch.get("kv_scale"),
                      sinks=batch.get("sinks"), sink_tokens=sink_tokens)
        with unittest.mock.patch.object(torch, "empty", _poisoned_empty(torch.empty)) if poison \
                else contextlib.nullcontext():
            out = triton_attention.paged_attention_launch(*args, **kwargs)
        if merge:
            again = triton_attention.paged_attention_launch(*args, **kwargs)
            torch.testing.assert_close(again, out, atol=0, rtol=0, equal_nan=True)
    assert not out.isnan().any(), "read an unwritten cache slot"
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def check_attention_a8(device, head_dim, num_splits, order, dtype=torch.bfloat16):
    """`paged_attention(..., a8_order=...)`: the output of the launch without codes, bit for bit, and
    its rows [T, H * D] as `quantize_a8` writes them, from the split merge (head_dim whole blocks of
    32) or, unsplit or with a head_dim the merge's columns do not cover in whole blocks, from one
    quantize launch after."""
    triton_attention, quant_triton = _triton_module("attention"), _triton_module("quant")
    group = 4
    batch, _, _ = make_paged_batch(DECODE_BATCH, group * NUM_KV_HEADS, NUM_KV_HEADS, dtype, device,
                                   seed=head_dim + num_splits, head_dim=head_dim)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
            batch["query_start_loc"], batch["max_query_len"], head_dim ** -0.5, None, num_splits)
    plain = triton_attention.paged_attention_launch(*args, merge=False)
    merged = num_splits > 1 and head_dim & (head_dim - 1) == 0  # the merge writes them: no quantize launch
    quantize = quant_triton.quantize_a8
    if merged:
        def refused(*_):
            raise AssertionError("the split merge should have written the codes")
        quant_triton.quantize_a8 = refused
    try:
        out, q, d = triton_attention.paged_attention_launch(*args, merge=False, a8_order=order)
    finally:
        quant_triton.quantize_a8 = quantize
    assert torch.equal(out, plain)
    q_ref, d_ref = quant_triton.quantize_a8(plain.view(plain.shape[0], -1), order)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)


def check_store_kv(device, dtype):
    triton_attention = _triton_module("attention")
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(9, 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(device)
    k, v = kv[:, :NUM_KV_HEADS], kv[:, NUM_KV_HEADS:]  # strided views, as from a fused projection
    slots = torch.randperm(4 * BLOCK_SIZE, generator=gen)[:9]
    slots[4] = -1  # a padding row
    caches = [torch.full((4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype,
                         device=device) for _ in range(4)]
    attention.store_kv(k, v, caches[0], caches[1], slots.to(device))
    triton_attention.store_kv(k, v, caches[2], caches[3], slots.to(device))
    torch.testing.assert_close(caches[2], caches[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0, equal_nan=True)


def check_store_kv_fp8(device, dtype, num_kv_heads, head_dim):
    """Triton's fp8 store writes the reference's bytes, for any scales (divided, IEEE-rounded,
    as torch divides): values in range, beyond it (saturated) and below its subnormals."""
    triton_attention = _triton_module("attention")
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    kv = torch.randn(9, 2 * num_kv_heads, head_dim, generator=gen)
    kv *= 10.0 ** torch.randint(-4, 3, kv.shape, generator=gen)  # 1e-4 .. 1e2 times
    kv = kv.to(dtype).to(device)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided views, as from a fused projection
    kv_scale = (torch.rand(2, num_kv_heads, generator=gen) / 20).to(device)  # not powers of two
    slots = torch.randperm(4 * BLOCK_SIZE, generator=gen)[:9]
    slots[4] = -1  # a padding row
    caches = [fp8_nan_cache((4, BLOCK_SIZE, num_kv_heads, head_dim), device) for _ in range(4)]
    attention.store_kv(k, v, caches[0], caches[1], slots.to(device), kv_scale)
    triton_attention.store_kv(k, v, caches[2], caches[3], slots.to(device), kv_scale)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (caches[0].view(torch.uint8) != 0x7F).sum() == 2 * 8 * num_kv_heads * head_dim // 2, \
        "8 rows written, none of them NaN"


NORM_STYLES = {"llama": (False, False), "gemma": (True, False), "gpt_oss": (False, True)}
"""The norms' arithmetic by family: (unit_offset, cast_last) of `hibana_kernels.norm.rms_norm`."""


def check_norms(device, dtype, shape, style):
    """style: one of NORM_STYLES (Gemma's weights around 0, the others' around 1)."""
    triton_norm = _triton_module("norm")
    flags = NORM_STYLES[style]
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype).to(device)
    residual = torch.randn(*shape, generator=gen).to(dtype).to(device)
    weight = ((0 if style == "gemma" else 1) + torch.randn(shape[-1], generator=gen) / 4).to(dtype).to(device)
    x_strided = torch.cat([x, x], dim=-1)[..., : shape[-1]]  # rows not contiguous
    for inp in (x, x_strided):
        out = triton_norm.rms_norm(inp, weight, 1e-6, *flags)
        assert out.dtype == norm.rms_norm(inp, weight, 1e-6, *flags).dtype
        torch.testing.assert_close(out, norm.rms_norm(inp, weight, 1e-6, *flags), **TOLERANCE[dtype])
    out, new_residual = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5, *flags)
    ref_out, ref_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5, *flags)
    torch.testing.assert_close(new_residual, ref_residual, **_exact(device, dtype))
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])


def rotary_tables(max_pos, head_dim, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def check_rotary(device, dtype, num_heads, head_dim, rotary_dim):
    """rotary_dim < head_dim: partial rotary (Phi), the first rotary_dim dims of each head."""
    triton_rotary = _triton_module("rotary")
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    max_pos, tokens = 300, 11
    cos, sin = rotary_tables(max_pos, rotary_dim, device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)[..., :rotary_dim]
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + NUM_KV_HEADS]  # strided views
    out_q, out_k = triton_rotary.rotary_embedding(positions, q, k, cos, sin)
    ref_q, ref_k = rotary.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(out_q, ref_q, **TOLERANCE[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOLERANCE[dtype])


def check_silu_and_mul(device, dtype, inter):
    triton_activation = _triton_module("activation")
    gen = torch.Generator().manual_seed(inter)
    gate_up = (3 * torch.randn(5, 2 * inter, generator=gen)).to(dtype).to(device)
    torch.testing.assert_close(triton_activation.silu_and_mul(gate_up),
                               activation.silu_and_mul(gate_up), **TOLERANCE[dtype])


def check_sigmoid_gate(device, dtype, heads, head_dim):
    """The attention output's gate: x [T, H, D] times sigmoid of q_proj's gate rows, a strided view
    ([T, H, 2D]: each head's q, then its gate), as the reference; bad shapes refused."""
    triton_activation = _triton_module("activation")
    gen = torch.Generator().manual_seed(heads * head_dim)
    x = (2 * torch.randn(3, heads, head_dim, generator=gen)).to(dtype).to(device)
    q_gate = (4 * torch.randn(3, heads, 2 * head_dim, generator=gen)).to(dtype).to(device)
    gate = q_gate.split(head_dim, dim=-1)[1]
    assert not gate.is_contiguous()
    out = triton_activation.sigmoid_gate(x, gate)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, activation.sigmoid_gate(x, gate), **TOLERANCE[dtype])
    torch.testing.assert_close(out, x * torch.sigmoid(gate.contiguous()), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="sigmoid_gate wants"):
        triton_activation.sigmoid_gate(x, gate[:, :, :-1])


def check_add_sigmoid_gated(device, dtype, width):
    """A shared expert's output scaled by its per-token gate, added to the routed experts': as the
    reference (torch's three ops); bad shapes refused."""
    triton_activation = _triton_module("activation")
    gen = torch.Generator().manual_seed(width)
    base, x = ((2 * torch.randn(5, width, generator=gen)).to(dtype).to(device) for _ in range(2))
    gate = (4 * torch.randn(5, 1, generator=gen)).to(dtype).to(device)
    out = triton_activation.add_sigmoid_gated(base, gate, x)
    assert out.shape == x.shape and out.dtype == dtype
    # three chained roundings: where one rounds the other way (the interpreter's bf16 truncates), the
    # sum is a unit of its operands' last place off (0.0625 at 8), which near zero is all of it
    tolerance = dict(atol=0.07, rtol=2e-2) if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(out, activation.add_sigmoid_gated(base, gate, x), **tolerance)
    with pytest.raises(ValueError, match="add_sigmoid_gated wants"):
        triton_activation.add_sigmoid_gated(base, gate[:, 0], x)


def check_qk_norm_rotary_store(device, dtype, num_heads, head_dim, qk_norm, kv_fp8=False,
                               rotary_dim=None, unit_offset=False):
    """kv_fp8: into fp8 caches (the same bytes as the reference's in float32; in 16 bits the
    rotated k is rounded before it is quantized, and the kernel's fused multiply-adds may round
    it one unit the other way, so a key may take the neighbouring fp8 code (seen on the H200 in
    bf16: 1 byte of 224); under the interpreter, whose bf16 roundings of k are a few units off,
    keys may be off by as much, plus an fp8 step). rotary_dim < head_dim: Phi's partial rotary
    (the tables that wide). unit_offset: Gemma's q/k norms."""
    triton_rotary = _triton_module("rotary")
    gen = torch.Generator().manual_seed(num_heads * head_dim + qk_norm)
    max_pos, tokens = 300, 7
    cos, sin = rotary_tables(max_pos, rotary_dim or head_dim, device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)  # q, k, v: strided views, as from the fused projection
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    weights = (None, None, 0.0)
    if qk_norm:
        weights = tuple((1 + torch.randn(head_dim, generator=gen) / 4).to(dtype).to(device)
                        for _ in range(2)) + (1e-6,)
    slots = torch.randperm(4 * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    slots[2] = -1  # a padding row: its q is still rotated, nothing is stored
    shape = (4, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    caches = [fp8_nan_cache(shape, device) if kv_fp8 else
              torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]
    kv_scale = fp8_scales(NUM_KV_HEADS, gen).to(device) if kv_fp8 else None
    ref_q = rotary.qk_norm_rotary_store(positions, q, k, v, cos, sin, caches[0], caches[1], slots,
                                        *weights, kv_scale, unit_offset)
    out_q = triton_rotary.qk_norm_rotary_store(positions, q, k, v, cos, sin, caches[2], caches[3],
                                               slots, *weights, kv_scale, unit_offset)
    if rotary_dim and not qk_norm:  # the dims past rotary_dim pass through, bit for bit
        assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])
    # four chained bf16 roundings, which the interpreter truncates: a few units off there
    tolerance = dict(atol=0.1, rtol=2e-2) if device == "cpu" and qk_norm else TOLERANCE[dtype]
    torch.testing.assert_close(out_q, ref_q, **tolerance)
    assert_prologue_caches(device, dtype, caches[2:], caches[:2], kv_scale, tolerance)


def assert_prologue_caches(device, dtype, got, want, kv_scale, tolerance):
    """(k_cache, v_cache) a prologue kernel wrote against the reference's: the values copied bit
    for bit, the keys within `tolerance`; into fp8 caches, in float32 the same bytes, in 16 bits
    the keys' codes the same or neighbours."""
    if kv_scale is not None:
        got_k, want_k = got[0].view(torch.uint8), want[0].view(torch.uint8)
        if dtype == torch.float32:
            assert torch.equal(got_k, want_k)
        else:
            # a 16-bit key rounds differently (the interpreter truncates; CUDA fuses a multiply-add), so
            # a code may be its neighbour (one step: up to 2^-3 of the value, e4m3 keeps 3 mantissa
            # bits), or near zero +0 against the smallest negative subnormal
            assert (got_k == want_k).float().mean() > (0.9 if device == "cpu" else 0.98)
            back = [attention.dequantize_kv(c, kv_scale[0], torch.float32) for c in (got[0], want[0])]
            torch.testing.assert_close(back[0], back[1], atol=0.1, rtol=2 ** -3, equal_nan=True)
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
        return
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **tolerance)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0, equal_nan=True)


def check_attention_prologue(device, dtype, lens, group, head_dim, num_splits, window=None, rotary_dim=None,
                             qk_norm=True, unit_offset=False, kv_fp8=False, unstored=None):
    """Decode attention with the layer's prologue folded in (`paged_attention_launch(prologue=)`)
    against the reference prologue then the reference attention: the output, and the caches (the
    new tokens' keys and values stored, every other slot untouched). The new tokens' slots start
    as NaN: a program that read a new key before it was stored (or another split's) gives NaN.
    Positions are not the keys' (as under LongRoPE's switch): the kernel rotates by `positions`.
    `unstored`: this sequence's slots are -1 (a padding row: nothing stored, the cache's old key read)."""
    triton_attention = _triton_module("attention")
    num_heads = group * NUM_KV_HEADS
    batch, _, _ = make_paged_batch(lens, num_heads, NUM_KV_HEADS, dtype, device, seed=head_dim + group + len(lens),
                                   head_dim=head_dim, kv_fp8=kv_fp8)
    gen = torch.Generator().manual_seed(group * head_dim)
    tokens = batch["q"].shape[0]
    qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)  # strided views, as in the model
    max_pos = 400
    cos, sin = rotary_tables(max_pos, rotary_dim or head_dim, device)
    weights = {}
    if qk_norm:
        weights = dict(q_weight=(1 + torch.randn(head_dim, generator=gen) / 4).to(dtype).to(device),
                       k_weight=(1 + torch.randn(head_dim, generator=gen) / 4).to(dtype).to(device),
                       eps=1e-6, unit_offset=unit_offset)
    tables, block_size = batch["block_tables"].cpu(), batch["k_cache"].shape[1]
    slots, positions = [], []
    for i, (seq_len, query_len) in enumerate(lens):
        for p in range(seq_len - query_len, seq_len):
            slots.append(-1 if i == unstored else int(tables[i, p // block_size]) * block_size + p % block_size)
            positions.append((p * 7 + 3) % max_pos)
    slots = torch.tensor(slots, device=device)
    prologue = rotary.AttentionPrologue(torch.tensor(positions, device=device), k, v, cos, sin, slots, **weights)
    for name in ("k_cache", "v_cache"):
        rows = batch[name].flatten(0, 1)
        stored = slots[slots >= 0]
        if rows.dtype == attention.FP8:
            rows.view(torch.uint8)[stored] = 0x7F
        else:
            rows[stored] = float("nan")
    kv_scale = batch.get("kv_scale")
    caches = {name: [batch[name].clone() for _ in range(2)] for name in ("k_cache", "v_cache")}
    ref_q = prologue.run(rotary, q, caches["k_cache"][0], caches["v_cache"][0], kv_scale)
    rest = dict(block_tables=batch["block_tables"], seq_lens=batch["seq_lens"],
                query_start_loc=batch["query_start_loc"], max_query_len=batch["max_query_len"],
                scale=head_dim ** -0.5, sliding_window=window, kv_scale=kv_scale)
    expected = attention.paged_attention(ref_q, caches["k_cache"][0], caches["v_cache"][0],
                                         max_seq_len=batch["max_seq_len"], **rest)
    rest.pop("max_query_len")
    out = triton_attention.paged_attention_launch(
        q, caches["k_cache"][1], caches["v_cache"][1], max_query_len=batch["max_query_len"],
        num_splits=num_splits, decode=True, prologue=prologue, **rest)
    assert not out.isnan().any(), "read a new key or value before it was stored"
    tolerance = dict(atol=0.1, rtol=2e-2) if device == "cpu" and dtype != torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, **tolerance)
    assert_prologue_caches(device, dtype, (caches["k_cache"][1], caches["v_cache"][1]),
                           (caches["k_cache"][0], caches["v_cache"][0]), kv_scale, tolerance)


def check_linear(device, dtype, rows, n, k, bias, tiles):
    """The Triton GEMV against F.linear; `tiles` (BLOCK_N, BLOCK_K, num_warps) or None for the
    dispatcher's own choice (which sends float32 and large batches to cuBLAS)."""
    triton_matmul = _triton_module("matmul")
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    ref = matmul.linear(x.double(), w.double(), None if b is None else b.double())
    if tiles is None:
        out = triton_matmul.linear(x, w, b)
    else:
        out = triton_matmul.linear_launch(x, w, b, *tiles)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])


def _fused_inputs(dtype, device, rows, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return gen, x, w, b


def check_rms_norm_linear(device, dtype, rows, n, k, bias, residual, tiles, unit_offset=False):
    """The norm-then-GEMV (through the dispatcher, `tiles` None, or forced with those tiles)
    against the references composed: the norm in `dtype`, the product in float64; and against
    the separate Triton kernels (fusion off). The new residual is exact. unit_offset: Gemma's norm
    (by 1 + weight, a weight near zero)."""
    triton_matmul = _triton_module("matmul")
    gen, x, w, b = _fused_inputs(dtype, device, rows, n, k, bias, seed=rows * n + k + residual)
    res = torch.randn(rows, k, generator=gen).to(dtype).to(device) if residual else None
    norm_weight = (int(not unit_offset) + torch.randn(k, generator=gen) / 4).to(dtype).to(device)
    normed, ref_res = (norm.fused_add_rms_norm(x, res, norm_weight, 1e-6, unit_offset) if residual
                       else (norm.rms_norm(x, norm_weight, 1e-6, unit_offset), x))
    ref = matmul.linear(normed.double(), w.double(), None if b is None else b.double())
    if tiles is None:
        out, new_res = triton_matmul.rms_norm_linear(x, res, norm_weight, 1e-6, w, b, unit_offset=unit_offset)
    else:
        out, new_res = triton_matmul.rms_norm_linear_launch(x, res, norm_weight, 1e-6, w, b, *tiles,
                                                            unit_offset=unit_offset)
    assert out.shape == (rows, n) and out.dtype == dtype and new_res.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    torch.testing.assert_close(new_res, ref_res, **_exact(device, dtype))
    with fusion.using("off"):
        separate, separate_res = triton_matmul.rms_norm_linear(x, res, norm_weight, 1e-6, w, b,
                                                               unit_offset=unit_offset)
    torch.testing.assert_close(out, separate, **TOLERANCE[dtype])
    torch.testing.assert_close(new_res, separate_res, atol=0, rtol=0)


def check_silu_and_mul_linear(device, dtype, rows, n, k, bias, tiles):
    """The down GEMV on silu(gate) * up of a [rows, 2k] gate/up output, as check_rms_norm_linear."""
    triton_matmul = _triton_module("matmul")
    _, gate_up, w, b = _fused_inputs(dtype, device, rows, n, 2 * k, bias, seed=rows * n + k)
    w = w[:, :k].contiguous()
    ref = matmul.linear(activation.silu_and_mul(gate_up).double(), w.double(),
                        None if b is None else b.double())
    if tiles is None:
        out = triton_matmul.silu_and_mul_linear(gate_up, w, b)
    else:
        out = triton_matmul.linear_launch(gate_up, w, b, *tiles[:3], silu_input=True, unroll=tiles[3:] == (True,))
    assert out.shape == (rows, n) and out.dtype == dtype
    # two chained bf16 roundings per input, which the interpreter truncates: summed over k
    # inputs, some outputs near zero are a few hundredths off there
    tolerance = dict(atol=0.1, rtol=2e-2) if device == "cpu" and dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, **tolerance)
    with fusion.using("off"):
        separate = triton_matmul.silu_and_mul_linear(gate_up, w, b)
    torch.testing.assert_close(out, separate, **TOLERANCE[dtype])


def check_linear_glu(device, dtype, rows, n, k, bias, tiles, glu, normed):
    """The gate/up GEMV ([2n, k] weight) with the activation in its epilogue, plain or after the
    norm (with a residual), through the dispatcher (`tiles` None) or forced on those tiles:
    against the same GEMV activated separately (same tiles, so the same sums: silu's result is
    exact, tanh gelu's within its tanh) and against the references in float64."""
    triton_matmul = _triton_module("matmul")
    gen, x, w, b = _fused_inputs(dtype, device, rows, 2 * n, k, bias, seed=rows * n + k + normed)
    res = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    nw = (1 + torch.randn(k, generator=gen) / 4).to(dtype).to(device)
    epilogue = dataclasses.replace(fusion.AUTO, silu_max_k=0, glu_silu_max_n=sys.maxsize, glu_gelu=True)
    separate = dataclasses.replace(fusion.AUTO, glu_silu_max_n=0, glu_gelu=False)

    def run(inside: bool):
        if tiles is None:
            with fusion.using(epilogue if inside else separate):
                if normed:
                    return triton_matmul.rms_norm_linear(x, res, nw, 1e-6, w, b, glu)[0]
                return triton_matmul.linear(x, w, b, glu)
        if normed:
            y = triton_matmul.rms_norm_linear_launch(x, res, nw, 1e-6, w, b, *tiles[:3], glu=glu if inside else None)[0]
        else:
            y = triton_matmul.linear_launch(x, w, b, *tiles[:3], unroll=tiles[3:] == (True,), glu=glu if inside else None)
        return y if inside else triton_matmul._activated(y, glu)

    out = run(inside=True)
    assert out.shape == (rows, n) and out.dtype == dtype
    inputs = norm.fused_add_rms_norm(x, res, nw, 1e-6)[0] if normed else x
    ref = matmul.linear(inputs.double(), w.double(), None if b is None else b.double(), glu)
    tolerance = dict(atol=0.1, rtol=2e-2) if device == "cpu" and dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, **tolerance)
    exact = _exact(device, dtype) if glu == "silu" else TOLERANCE[dtype]
    torch.testing.assert_close(out, run(inside=False), **exact)


def check_glu_dispatch(device):
    """One bf16 row takes silu and tanh gelu into the gate/up GEMV under a policy with the
    epilogue on, plain and after the norm (folded or not): no activation launch; under one
    without it, and for two rows, the separate activation runs once each."""
    triton_matmul = _triton_module("matmul")
    calls = []
    originals = triton_matmul.silu_and_mul, triton_matmul.activation.gelu_tanh_and_mul
    triton_matmul.silu_and_mul = lambda gate_up: calls.append("silu") or originals[0](gate_up)
    triton_matmul.activation.gelu_tanh_and_mul = lambda gate_up: calls.append("gelu_tanh") or originals[1](gate_up)
    try:
        _, x, w, _ = _fused_inputs(torch.bfloat16, device, 2, 48, 64, False, seed=2)
        nw = torch.ones(64, dtype=torch.bfloat16, device=device)
        on = dataclasses.replace(fusion.AUTO, silu_max_k=0, glu_silu_max_n=sys.maxsize, glu_gelu=True)
        norm_apart = dataclasses.replace(on, norm_max_k=32)
        every = ["silu", "gelu_tanh"] * 3
        for policy, rows, separate in ((on, 1, []), (norm_apart, 1, []), (fusion.OFF, 1, every), (on, 2, every)):
            calls.clear()
            with fusion.using(policy):
                for glu in ("silu", "gelu_tanh"):
                    assert triton_matmul.folds_glu(x[:rows], w, glu) == (not separate), (policy, rows, glu)
                for glu in ("silu", "gelu_tanh"):
                    assert triton_matmul.linear(x[:rows], w, glu=glu).shape == (rows, 24)
                for residual in (x[:rows], None):
                    for glu in ("silu", "gelu_tanh"):
                        assert triton_matmul.rms_norm_linear(x[:rows], residual, nw, 1e-6, w, glu=glu)[0].shape == (rows, 24)
            assert calls == separate, (policy, rows, calls)
        with fusion.using(on):
            assert not triton_matmul.folds_glu(x[:1].float(), w.float(), "silu")
    finally:
        triton_matmul.silu_and_mul, triton_matmul.activation.gelu_tanh_and_mul = originals


def check_fusion_dispatch(device):
    """One bf16 row folds the norm and the activation into the GEMV under a policy that takes
    the width, and runs the separate kernels under one that does not; two rows never fold."""
    triton_matmul = _triton_module("matmul")
    calls = []

    def counted(name, fn):
        return lambda *args: calls.append(name) or fn(*args)

    norm_module = triton_matmul.norm_triton
    originals = (norm_module.fused_add_rms_norm, norm_module.rms_norm, triton_matmul.silu_and_mul)
    norm_module.fused_add_rms_norm = counted("norm", originals[0])
    norm_module.rms_norm = counted("norm", originals[1])
    triton_matmul.silu_and_mul = counted("silu", originals[2])
    try:
        _, x, w, _ = _fused_inputs(torch.bfloat16, device, 2, 24, 64, False, seed=1)
        nw = torch.ones(64, dtype=torch.bfloat16, device=device)
        narrow = fusion.Fusion(norm_max_k=63, silu_max_k=31, attention_merge=True)
        for policy, rows, separate in (("on", 1, []), (narrow, 1, ["norm", "norm", "silu"]),
                                       ("on", 2, ["norm", "norm", "silu"])):
            calls.clear()
            with fusion.using(policy):
                triton_matmul.rms_norm_linear(x[:rows], x[:rows], nw, 1e-6, w)
                triton_matmul.rms_norm_linear(x[:rows], None, nw, 1e-6, w)
                triton_matmul.silu_and_mul_linear(x[:rows], w[:, :32].contiguous())
            assert calls == separate, (policy, rows, calls)
    finally:
        norm_module.fused_add_rms_norm, norm_module.rms_norm, triton_matmul.silu_and_mul = originals


def check_linear_quant(device, dtype, bits, lead, n, k, group_size, bias, tiles):
    """linear_int8 / linear_int4 against their references (in float64) on x [*lead, k]; `tiles`
    ("gemv" or "gemm", the tile sizes) forces a kernel, None lets the dispatcher pick by rows."""
    quant_triton = _triton_module("quant")
    if tiles is not None:
        kernel, sizes = tiles
        tiles = {"gemv": quant_triton.GemvTiles, "gemm": quant_triton.GemmTiles,
                 "dot": quant_triton.DotTiles}[kernel](*sizes)
    gen = torch.Generator().manual_seed(bits * n + k + len(lead))
    qweight, scales, zeros = (t if t is None else t.to(device)
                              for t in make_quant_weight(bits, n, k, group_size, gen))
    x = torch.randn(*lead, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    b64 = None if b is None else b.double()
    if bits == 8:
        ref = quant.linear_int8(x.double(), qweight, scales, b64)
        out = (quant_triton.linear_int8(x, qweight, scales, b) if tiles is None else
               quant_triton.linear_int8_launch(x, qweight, scales, b, tiles))
    else:
        ref = quant.linear_int4(x.double(), qweight, scales, zeros, group_size, b64)
        out = (quant_triton.linear_int4(x, qweight, scales, zeros, group_size, b) if tiles is None
               else quant_triton.linear_int4_launch(x, qweight, scales, zeros, group_size, b, tiles))
    assert out.shape == (*lead, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    if isinstance(tiles, quant_triton.DotTiles) and tiles.splits > 1:  # each output tile's last
        counts = counters.counters("int4 split-K", quant_triton.DOT_COUNTERS, x.device)  # program
        assert not counts.any(), counts.nonzero()  # set its arrival count back to zero


def check_int4_dot_split_falls_back(device):
    """More output tiles than the split-K's arrival counts: the launch runs unsplit, still right."""
    quant_triton = _triton_module("quant")
    gen = torch.Generator().manual_seed(7)
    qweight, scales, zeros = (t.to(device) for t in make_quant_weight(4, 48, 256, 128, gen))
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(device)
    counts = quant_triton.DOT_COUNTERS
    quant_triton.DOT_COUNTERS = 2  # 3 output tiles of 16 features
    try:
        out = quant_triton.linear_int4_launch(x, qweight, scales, zeros, 128, None, quant_triton.DotTiles(16, 2, 4, 1))
    finally:
        quant_triton.DOT_COUNTERS = counts
    ref = quant.linear_int4(x.double(), qweight, scales, zeros, 128)
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[torch.bfloat16])


def test_int4_dot_split_falls_back(run_check):
    run_check(check_int4_dot_split_falls_back)


def test_quant_dispatch_at_one_row():
    """One row of 16-bit x takes the x int8 GEMV: int4 with groups of whole blocks of 32 (per
    channel too), int8 with K a whole number of blocks; float32 x, int4 groups of 16 and K not
    a whole number of blocks do not, nor two rows, nor any with A8_MAX_ROWS 0 (HIBANA_A8_ROWS=0)."""
    from hibana_kernels import quant_triton

    choose, a8 = quant_triton.choose_tiles, quant_triton.A8GemvTiles(2, 2048, 2)
    for group, k, dtype in ((128, 4096, torch.bfloat16), (32, 12288, torch.float16), (4096, 4096, torch.bfloat16),
                            (1, 4096, torch.bfloat16), (1, 96, torch.float16)):
        assert choose(1, 4096, k, group, dtype, 132) == a8, (group, k, dtype)
    for rows, group, k, dtype in ((1, 128, 4096, torch.float32), (1, 16, 4096, torch.bfloat16),
                                  (1, 1, 100, torch.bfloat16), (2, 128, 4096, torch.bfloat16), (2, 1, 4096, torch.bfloat16)):
        assert not isinstance(choose(rows, 4096, k, group, dtype, 132), quant_triton.A8GemvTiles), (rows, group, k)
    a8_rows, quant_triton.A8_MAX_ROWS = quant_triton.A8_MAX_ROWS, 0
    try:
        assert isinstance(choose(1, 4096, 4096, 128, torch.bfloat16, 132), quant_triton.DotTiles)
        quant_triton.A8_MAX_ROWS = 4  # several rows: all of them in one program
        assert choose(3, 4096, 4096, 128, torch.bfloat16, 132) == a8._replace(block_m=4)
    finally:
        quant_triton.A8_MAX_ROWS = a8_rows


def test_a8_rows_setting(monkeypatch):
    """HIBANA_A8_ROWS: a whole number of rows (0: off); unset, empty or anything else: the default,
    one row (a bad value must not stop the kernels from importing)."""
    from hibana_kernels import quant_triton

    for value, rows in (("0", 0), ("4", 4), (" 2 ", 2), ("", 1), ("off", 1), ("-1", 1), ("1.5", 1)):
        monkeypatch.setenv("HIBANA_A8_ROWS", value)
        assert quant_triton._a8_rows_setting() == rows, value
    monkeypatch.delenv("HIBANA_A8_ROWS")
    assert quant_triton._a8_rows_setting() == 1


def test_int4_dispatch(monkeypatch):
    """Without the x int8 GEMV (one row takes it by default: above), up to 127 rows of 16-bit x
    with groups of 128-256 take the int4 words kernel (256 features a program, PREFETCH, 16, 32 or
    64 rows a program), K split until the grid has about a program an SM and in 4 at least (half
    that from 65 rows); groups of 32 and 64 the byte kernel at decode rows, the GEMM above; float32
    x and small or per-channel groups the GEMV; from 128 rows cuBLAS."""
    from hibana_kernels import quant_triton

    monkeypatch.setattr(quant_triton, "A8_MAX_ROWS", 0)
    choose, Dot = quant_triton.choose_tiles, quant_triton.DotTiles
    words = dict(num_warps=8, num_stages=3, words=True, prefetch=True)
    assert choose(1, 24576, 4096, 128, torch.bfloat16, 132) == Dot(256, 4, **words)  # 4 at least
    assert choose(1, 4096, 12288, 128, torch.float16, 132) == Dot(256, 8, **words)  # 16 output tiles
    assert choose(1, 4096, 4096, 128, torch.bfloat16, 132) == Dot(256, 8, **words)
    assert choose(3, 6144, 4096, 256, torch.bfloat16, 132).splits == 8
    assert choose(1, 4096, 256, 128, torch.bfloat16, 132).splits == 2  # no more than the groups
    assert choose(16, 4096, 4096, 128, torch.bfloat16, 132) == Dot(256, 8, **words, block_m=16)
    assert choose(17, 4096, 4096, 128, torch.bfloat16, 132) == Dot(256, 8, **words, block_m=32)
    assert choose(32, 24576, 4096, 128, torch.bfloat16, 132) == Dot(256, 4, **words, block_m=32)
    assert choose(1, 24576, 4096, 64, torch.bfloat16, 132) == Dot(64, 1, 4, 4)
    assert choose(1, 4096, 4096, 32, torch.float16, 132).splits == 8  # 64 output tiles
    assert choose(4, 6144, 4096, 64, torch.bfloat16, 132).splits == 4
    for rows, group, dtype in ((1, 128, torch.float32), (1, 16, torch.bfloat16), (1, 4096, torch.bfloat16),
                               (1, 512, torch.bfloat16)):
        assert isinstance(choose(rows, 4096, 4096, group, dtype, 132), quant_triton.GemvTiles), (group, dtype)
    assert choose(64, 4096, 4096, 128, torch.bfloat16, 132) == Dot(256, 8, **words, block_m=64)
    assert choose(65, 4096, 4096, 128, torch.bfloat16, 132) == Dot(256, 4, **words, block_m=64)
    assert choose(127, 24576, 4096, 128, torch.bfloat16, 132) == Dot(256, 2, **words, block_m=64)
    for rows, group, dtype in ((5, 64, torch.bfloat16), (33, 32, torch.bfloat16), (33, 128, torch.float32)):
        assert isinstance(choose(rows, 4096, 4096, group, dtype, 132), quant_triton.GemmTiles), rows
    assert choose(128, 4096, 4096, 128, torch.bfloat16, 132) is None  # dequantize, then cuBLAS


def check_linear_fp8(device, dtype, lead, n, k, block, bias, tiles):
    """linear_fp8 against its reference (in float64) on x [*lead, k]; `tiles` ("gemv", "gemm" or
    "dequantize", with tile sizes) forces a path, None lets the dispatcher pick by rows."""
    quant_triton = _triton_module("quant")
    forced = tiles is not None
    if forced:
        kernel, sizes = tiles
        tiles = {"gemv": quant_triton.GemvTiles, "gemm": quant_triton.GemmTiles,
                 "dequantize": lambda: None}[kernel](*sizes)  # the launcher's None: dequantize
    gen = torch.Generator().manual_seed(n * k + block[0] + len(lead))
    qweight, scales = (t.to(device) for t in make_fp8_weight(n, k, block, gen))
    x = torch.randn(*lead, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    ref = quant.linear_fp8(x.double(), qweight, scales, block, None if b is None else b.double())
    out = (quant_triton.linear_fp8_launch(x, qweight, scales, block, b, tiles) if forced
           else quant_triton.linear_fp8(x, qweight, scales, block, b))
    assert out.shape == (*lead, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    w = quant_triton.dequantize_fp8(qweight, scales, block, dtype)
    torch.testing.assert_close(w, quant.dequantize_fp8(qweight, scales, block, dtype), **_exact(device, dtype))

# ---------------------------------------------------------------------------------------------
# the interpreter worker


def _start_interpreter():
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead


def _interpreter_problem():
    """Why this triton's interpreter cannot run the constructs the kernels use, or None. (Seen:
    triton 3.6 with numpy 2.4 cannot bound a loop by a loaded value, its scalars being 1-element
    arrays that int() refuses; triton 3.0 with numpy 2.4 cannot even run tl.arange.)"""
    import triton
    import triton.language as tl
    globals()["tl"] = tl  # triton 3.0 looks for triton.language among a kernel's globals

    @triton.jit
    def probe(n_ptr, out_ptr, BLOCK: tl.constexpr):
        total = tl.zeros([BLOCK], dtype=tl.int64)
        for i in range(0, tl.load(n_ptr + tl.program_id(0))):
            total += i
        tl.store(out_ptr + tl.arange(0, BLOCK), total)

    out = torch.zeros(16, dtype=torch.int64)
    try:
        probe[(1,)](torch.tensor([3]), out, BLOCK=16)
    except Exception as error:  # noqa: BLE001 - any failure means the same: cannot run here
        return f"triton {triton.__version__}'s interpreter is broken here: {error!r}"
    if out.tolist() != [3] * 16:
        return f"triton {triton.__version__}'s interpreter computes wrong results here"
    return None


@pytest.fixture(scope="module")
def interpreter_worker():
    """(worker, problem): the worker process, and why it cannot run the checks (or None)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: triton not imported
    with ProcessPoolExecutor(max_workers=1, mp_context=context,
                             initializer=_start_interpreter) as worker:
        yield worker, worker.submit(_interpreter_problem).result()


@pytest.fixture(params=DEVICES)
def run_check(request):
    """run_check(check, **params): on CPU tensors in the interpreter worker, or here on CUDA."""
    if request.param == "cuda":
        return lambda check, **params: check("cuda", **params)
    worker, problem = request.getfixturevalue("interpreter_worker")
    if problem:
        pytest.skip(problem)
    return lambda check, **params: worker.submit(check, "cpu", **params).result()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="triton is a dependency on Linux only")
def test_the_triton_interpreter_runs_here(request):
    """Triton is a declared test dependency on Linux: missing or with a broken interpreter, every
    interpreter case below would skip and the suite would pass with no kernel checked. (Where
    CUDA is present the kernels are checked compiled, and the interpreter may be broken.)"""
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the kernels compiled here")
    assert HAS_TRITON, "triton is not installed; `pip install -e .[test]` installs it on Linux"
    _, problem = request.getfixturevalue("interpreter_worker")
    assert problem is None, problem


DTYPES = [torch.float32, torch.bfloat16]


# (lens, num_splits, merge); num_splits None: the entry point's own choice (here: 1). verify-3splits
# merges in-kernel at group 1 only (more rows than MERGE_MAX_ROWS: the separate merge)
PAGED_BATCHES = [pytest.param(MIXED_BATCH, None, None, id="mixed"),
                 pytest.param(DECODE_BATCH, None, None, id="decode"),
                 pytest.param(DECODE_BATCH, 3, True, id="decode-3splits"),
                 pytest.param(DECODE_BATCH, 3, False, id="decode-3splits-separate-merge"),
                 pytest.param(VERIFY_BATCH, None, None, id="verify"),
                 pytest.param(VERIFY_BATCH, 3, True, id="verify-3splits")]


# the default run takes each batch at every group once, the (window, dtype) pair turning with batch
# and group: every (batch, group), (batch, window, dtype) and (group, window, dtype) runs; the whole
# product with -m slow
@thinned("lens, num_splits, merge, window, group, dtype",
         lambda batch, window, group, dtype: 2 * dtype + window == (batch + group) % 4,
         PAGED_BATCHES, [None, WINDOW], [1, 2, 4, 8], DTYPES)
def test_paged_attention(run_check, lens, num_splits, merge, window, group, dtype):
    run_check(check_paged_attention, group=group, window=window, lens=lens, dtype=dtype,
              num_splits=num_splits, merge=merge)


# a group that is not a power of two (Qwen2.5-7B: 7), the tiny test models' head_dim 16, and a
# head_dim that is not a power of two (padded and masked)
@pytest.mark.parametrize("group, head_dim", [(7, 32), (2, 16), (2, 48)])
def test_paged_attention_odd_shapes(run_check, group, head_dim):
    for lens, num_splits, merge in ((MIXED_BATCH, None, None), (DECODE_BATCH, 2, True),
                                    (DECODE_BATCH, 2, False)):
        run_check(check_paged_attention, group=group, window=WINDOW, lens=lens,
                  dtype=torch.float32, num_splits=num_splits, head_dim=head_dim, merge=merge)


@pytest.mark.parametrize("head_dim, num_splits, order", [(32, 3, quant.A8_PAIRS), (64, 2, quant.A8_COLUMNS),
                                                          (32, 1, quant.A8_PAIRS), (48, 3, quant.A8_PAIRS)],
                         ids=["split", "split-int8-order", "unsplit", "head-dim-48"])
def test_attention_a8(run_check, head_dim, num_splits, order):
    run_check(check_attention_a8, head_dim=head_dim, num_splits=num_splits, order=order)


@pytest.mark.parametrize("merge", [False, True], ids=["separate-merge", "merge"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_paged_attention_splits_past_the_keys(run_check, merge, window):
    """Decode split for a longer sequence than any of the batch's (a graph's splits are for the
    engine's longest): the splits past a sequence's keys write no partials, and the merge reads
    only those of the splits that hold keys (the partials start as NaN)."""
    run_check(check_paged_attention, group=2, window=window, lens=DECODE_BATCH, dtype=torch.float32,
              num_splits=16, merge=merge, poison=True)


def check_split_counts_partition_alike(device, merge, window):
    """A decode graph captured for a short span splits fewer times than one for the engine's
    whole context (runner.DecodeGraphs.SPANS); on the sequences the short one covers both split
    the keys alike (one key tile a split), so their outputs are equal to the bit. (The merge's
    tile width, MERGE_TILE, matters to the bits on the GPU's tree reductions; the interpreter's
    numpy sums may agree whatever the width, so there only the partition is checked; and there
    the long span's splits are 4 times the short one's rather than MAX_SPLITS, whose empty splits
    the interpreter would run one by one: a fifth of the time, the same partition.)"""
    triton_attention = _triton_module("attention")
    batch, _, _ = make_paged_batch(DECODE_BATCH, 2 * NUM_KV_HEADS, NUM_KV_HEADS, torch.float32, device, seed=3)
    tile = max(triton_attention.DECODE_MIN_SPLIT, triton_attention._decode_tiles(torch.float32, HEAD_DIM, False)[0])
    short = -(-max(n for n, _ in DECODE_BATCH) // tile)  # the splits of a span just covering the batch
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
            batch["query_start_loc"], 1, HEAD_DIM ** -0.5, window)
    few = triton_attention.paged_attention_launch(*args, short, merge=merge)
    splits = triton_attention.MAX_SPLITS if device == "cuda" else 4 * short
    many = triton_attention.paged_attention_launch(*args, splits, merge=merge)
    assert short > 1 and not few.isnan().any()
    torch.testing.assert_close(few, many, atol=0, rtol=0)


@pytest.mark.parametrize("merge", [False, True], ids=["separate-merge", "merge"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_decode_split_counts_partition_alike(run_check, merge, window):
    run_check(check_split_counts_partition_alike, merge=merge, window=window)


def check_window_splits(device, sink_tokens):
    """A sliding layer's decode splits for its window's keys, however long the sequences (the
    bound overstated, as in graphs): fewer splits than for the sequence, the same output to the
    bit (the splits past the window held no keys)."""
    triton_attention = _triton_module("attention")
    lens = ((150, 1), (37, 1))
    batch, _, _ = make_paged_batch(lens, 2 * NUM_KV_HEADS, NUM_KV_HEADS, torch.float32, device, seed=5)
    batch["max_seq_len"] += 4000
    splits, launch = [], triton_attention.paged_attention_launch

    def spy(*args, **kwargs):
        splits.append(inspect.signature(launch).bind(*args, **kwargs).arguments["num_splits"])
        return launch(*args, **kwargs)
    kwargs = dict(scale=HEAD_DIM ** -0.5, sliding_window=WINDOW, sink_tokens=sink_tokens)
    with unittest.mock.patch.object(triton_attention, "paged_attention_launch", spy):
        windowed = triton_attention.paged_attention(**batch, **kwargs)
        with unittest.mock.patch.object(triton_attention, "WINDOW_SPLITS", False):
            whole = triton_attention.paged_attention(**batch, **kwargs)
    assert splits[0] == 1 < splits[1], splits  # WINDOW keys: one split tile
    torch.testing.assert_close(windowed, whole, atol=0, rtol=0)
    torch.testing.assert_close(windowed, attention.paged_attention(**batch, **kwargs), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("sink_tokens", [0, 4])
def test_decode_splits_for_the_window(run_check, sink_tokens):
    run_check(check_window_splits, sink_tokens=sink_tokens)


@pytest.mark.parametrize("lens", [DECODE_BATCH, MIXED_BATCH], ids=["decode", "mixed"])
def test_paged_attention_with_overstated_bounds(run_check, lens):
    run_check(check_paged_attention, group=2, window=None, lens=lens, dtype=torch.float32,
              num_splits=None, bounds_slack=4000)


# the default run takes each batch at each (group, window) in one dtype, turning: both dtypes meet
# every batch and every (group, window); the whole product with -m slow
@thinned("lens, num_splits, merge, group, window, dtype", lambda batch, shape, dtype: dtype == (batch + shape) % 2,
         PAGED_BATCHES[:5], [(1, None), (4, WINDOW), (8, None)], DTYPES)
def test_paged_attention_sinks(run_check, lens, num_splits, merge, group, window, dtype):
    """Sinks start the first split's online softmax (and no other split's)."""
    run_check(check_paged_attention, group=group, window=window, lens=lens, dtype=dtype,
              num_splits=num_splits, merge=merge, sinks=True)


SINK_TOKEN_BATCHES = [
    pytest.param(MIXED_BATCH, WINDOW, None, None, id="mixed"),
    pytest.param(MIXED_SHORT_BATCH, WINDOW, None, None, id="mixed_short"),
    pytest.param(VERIFY_BATCH, WINDOW, 3, False, id="verify-3splits"),
    pytest.param(LONG_DECODE_BATCH, LONG_WINDOW, 3, True, id="long-decode-3splits"),
    pytest.param(LONG_DECODE_BATCH, LONG_WINDOW, 3, False, id="long-decode-3splits-separate-merge")]
SINK_TOKENS = [1, 4, 20, 25, 1000]
# the default run: 1 sink token is as 4 are (fewer than the window, in the first key tile), and so
# under LONG_WINDOW are 20 and 25; mixed_short takes mixed's prefill kernel, past the window and all
# keys; the whole product with -m slow
SINK_TOKENS_DEFAULT = {"mixed": (4, 20, 25, 1000), "mixed_short": (25, 1000), "verify-3splits": (4, 20, 25, 1000),
                       "long-decode-3splits": (4, 1000), "long-decode-3splits-separate-merge": (4, 1000)}


@thinned("lens, window, num_splits, merge, sink_tokens",
         lambda batch, sinks: SINK_TOKENS[sinks] in SINK_TOKENS_DEFAULT[SINK_TOKEN_BATCHES[batch].id],
         SINK_TOKEN_BATCHES, SINK_TOKENS)
def test_paged_attention_sink_tokens(run_check, lens, window, num_splits, merge, sink_tokens):
    """StreamingLLM's sink tokens: a first loop over the keys before the window (in split decode,
    the first split's), with the gap between them and the window never read (it holds NaN)."""
    run_check(check_paged_attention, group=2, window=window, lens=lens, dtype=torch.float32,
              num_splits=num_splits, merge=merge, sink_tokens=sink_tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lens, window, num_splits",
                         [(MIXED_BATCH, WINDOW, None), (LONG_DECODE_BATCH, LONG_WINDOW, 3),
                          (VERIFY_BATCH, WINDOW, None)], ids=["mixed", "long-decode-3splits", "verify"])
def test_paged_attention_sink_tokens_with_sinks_and_fp8(run_check, dtype, lens, window, num_splits):
    """Sink tokens together with gpt-oss's sink logits and an fp8 cache."""
    run_check(check_paged_attention, group=4, window=window, lens=lens, dtype=dtype,
              num_splits=num_splits, merge=True, kv_fp8=True, sinks=True, sink_tokens=4)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_store_kv(run_check, dtype):
    run_check(check_store_kv, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 32), (3, 48), (8, 128)])
def test_store_kv_fp8(run_check, dtype, num_kv_heads, head_dim):
    run_check(check_store_kv_fp8, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)


# fp8 caches (kv8): decode (split and not), verify, mixed prefill, short-query batches; groups
# 1 to 7 (not a power of two), head_dim 16 and 48 (padded), a sliding window. The default run takes
# each batch at each shape in one dtype, turning: every dtype meets every batch and every shape; the
# whole product with -m slow
@thinned("lens, num_splits, group, head_dim, window, dtype", lambda batch, shape, dtype: dtype == (batch + shape) % 3,
         [pytest.param(MIXED_BATCH, None, id="mixed"), pytest.param(DECODE_BATCH, 3, id="decode-3splits"),
          pytest.param(VERIFY_BATCH, None, id="verify"), pytest.param(MIXED_SHORT_BATCH, None, id="mixed_short")],
         [(1, 32, None), (4, 16, WINDOW), (7, 48, None)], DTYPES + [torch.float16])
def test_paged_attention_fp8(run_check, lens, num_splits, group, head_dim, window, dtype):
    run_check(check_paged_attention, group=group, window=window, lens=lens, dtype=dtype,
              num_splits=num_splits, head_dim=head_dim, kv_fp8=True)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("num_heads, head_dim, qk_norm", [(4, 16, False), (14, 32, True), (6, 64, True)])
def test_qk_norm_rotary_store_fp8(run_check, dtype, num_heads, head_dim, qk_norm):
    run_check(check_qk_norm_rotary_store, dtype=dtype, num_heads=num_heads, head_dim=head_dim,
              qk_norm=qk_norm, kv_fp8=True)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32), (2, 1000)], ids=str)
@pytest.mark.parametrize("style", list(NORM_STYLES))
def test_norms(run_check, dtype, shape, style):
    run_check(check_norms, dtype=dtype, shape=shape, style=style)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_oss"])
def test_norm_reference_is_transformers(family):
    """The norm reference rounds as each family's RMSNorm in transformers, bit for bit in bf16 (in
    float32 the orders agree; in bf16 Llama's rounds before the weight's product, gpt-oss's and
    Gemma's after), and the models build the family's norm."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hibana_core.models import decoder

    theirs = {"llama": LlamaRMSNorm, "gemma3": Gemma3RMSNorm, "gpt_oss": GptOssRMSNorm}[family](256, eps=1e-6)
    ours = decoder.make_norm(SimpleNamespace(unit_offset_norms=family == "gemma3", cast_last_norms=family == "gpt_oss",
                                             rms_norm_eps=1e-6), 256)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        theirs.weight.copy_((0 if family == "gemma3" else 1) + torch.randn(256, generator=gen) / 4)
        ours.weight = torch.nn.Parameter(theirs.weight.detach().clone())
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = (3 * torch.randn(64, 256, generator=gen)).to(torch.bfloat16)
    with torch.no_grad():
        want = theirs(x)
        assert torch.equal(ours(x), want)
        flags = NORM_STYLES["gemma" if family == "gemma3" else family]
        assert torch.equal(norm.rms_norm(x, ours.weight, 1e-6, *flags), want)
    other = NORM_STYLES["gpt_oss" if family == "llama" else "llama"]
    assert not torch.equal(norm.rms_norm(x, ours.weight, 1e-6, *other), want), "the orders round alike here"
    if family == "gpt_oss":
        from transformers import GptOssConfig

        from hibana_core.models import gpt_oss
        assert gpt_oss.args_from_config(GptOssConfig()).cast_last_norms


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, head_dim, rotary_dim", [(4, 16, 16), (6, 64, 64), (6, 64, 48)])
def test_rotary_embedding(run_check, dtype, num_heads, head_dim, rotary_dim):
    run_check(check_rotary, dtype=dtype, num_heads=num_heads, head_dim=head_dim, rotary_dim=rotary_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [96, 1500])  # 1500: more than one program per row
def test_silu_and_mul(run_check, dtype, inter):
    run_check(check_silu_and_mul, dtype=dtype, inter=inter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [(2, 64), (6, 256), (3, 80)])  # 1536: two programs a row; 80: masked
def test_sigmoid_gate(run_check, dtype, heads, head_dim):
    run_check(check_sigmoid_gate, dtype=dtype, heads=heads, head_dim=head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [64, 2000])  # 2000: two programs a row, the second masked
def test_add_sigmoid_gated(run_check, dtype, width):
    run_check(check_add_sigmoid_gated, dtype=dtype, width=width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, head_dim", [(4, 16), (6, 64), (14, 32)])  # groups 2, 3, 7
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_qk_norm_rotary_store(run_check, dtype, num_heads, head_dim, qk_norm):
    run_check(check_qk_norm_rotary_store, dtype=dtype, num_heads=num_heads, head_dim=head_dim,
              qk_norm=qk_norm)


# (lens, num_splits, window): one token a sequence unsplit and over 3 splits (300 keys: a split of
# 128 each, the new key in the last), with a window over several key tiles; verify steps of 5
# tokens, one sequence's straddling two splits (positions 125-129 over splits of 64)
PROLOGUE_BATCHES = [(DECODE_BATCH, 1, None), (LONG_DECODE_BATCH, 3, None), (LONG_DECODE_BATCH, 3, LONG_WINDOW),
                    (VERIFY_BATCH[:4] + ((130, 5),), 3, None), (VERIFY_BATCH[:4] + ((130, 5),), 1, WINDOW)]


# the default run takes each batch at each group in one dtype, turning: both dtypes meet every
# batch and every group; the whole product with -m slow
@thinned("group, lens, num_splits, window, dtype", lambda group, batch, dtype: dtype == (group + batch) % 2,
         [1, 4, 7], [pytest.param(*batch, id=name) for batch, name in zip(PROLOGUE_BATCHES, [
             "decode", "decode-3splits", "decode-3splits-window", "verify-3splits", "verify-window"])], DTYPES)
def test_attention_prologue(run_check, group, lens, num_splits, window, dtype):
    run_check(check_attention_prologue, dtype=dtype, lens=lens, group=group, head_dim=HEAD_DIM,
              num_splits=num_splits, window=window, unstored=1)


# head dims: not a power of two, Phi's partial rotary (halves of 12, 8 dims through), without
# q/k norms, Gemma's norms; fp8 caches
@pytest.mark.parametrize("head_dim, rotary_dim, qk_norm, unit_offset", [
    (48, None, True, False), (32, 24, False, False), (32, None, False, False), (32, 24, True, True)], ids=str)
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["kv16", "kv8"])
def test_attention_prologue_heads(run_check, head_dim, rotary_dim, qk_norm, unit_offset, kv_fp8):
    run_check(check_attention_prologue, dtype=torch.bfloat16, lens=LONG_DECODE_BATCH, group=2, head_dim=head_dim,
              num_splits=3, rotary_dim=rotary_dim, qk_norm=qk_norm, unit_offset=unit_offset, kv_fp8=kv_fp8)


# partial rotary: Phi-4-mini's head (128 dims, 96 rotate: halves of 48, not a power of two) and
# group of 3; rotated halves of 12 and 8 passed through in groups of 7; one query head per KV head
# (group 1) with halves of 9 and 6 passed through (both masked); with q/k norms (no such model
# yet: the norm spans the whole head)
PARTIAL_ROTARY_CASES = [(6, 128, 96, False), (14, 32, 24, False), (2, 24, 18, False), (14, 32, 24, True)]


KV_CACHES = [pytest.param(False, id="kv16"), pytest.param(True, id="kv8")]


# the default run takes each case with each cache in one dtype, turning: every dtype meets both
# caches, every case two dtypes; the whole product with -m slow
@thinned("kv_fp8, num_heads, head_dim, rotary_dim, qk_norm, dtype", lambda kv, case, dtype: dtype == (kv + case) % 3,
         KV_CACHES, PARTIAL_ROTARY_CASES, DTYPES + [torch.float16])
def test_qk_norm_rotary_store_partial(run_check, kv_fp8, num_heads, head_dim, rotary_dim, qk_norm, dtype):
    run_check(check_qk_norm_rotary_store, dtype=dtype, num_heads=num_heads, head_dim=head_dim,
              qk_norm=qk_norm, kv_fp8=kv_fp8, rotary_dim=rotary_dim)


# the default run as test_qk_norm_rotary_store_partial's; the whole product with -m slow
@thinned("kv_fp8, num_heads, head_dim, rotary_dim, dtype", lambda kv, case, dtype: dtype == (kv + case) % 3,
         KV_CACHES, [(4, 16, None), (14, 32, None), (6, 64, 48)], DTYPES + [torch.float16])
def test_qk_norm_rotary_store_unit_offset(run_check, kv_fp8, num_heads, head_dim, rotary_dim, dtype):
    """Gemma's q/k norms, by (1 + weight) in float32, in the fused prologue."""
    run_check(check_qk_norm_rotary_store, dtype=dtype, num_heads=num_heads, head_dim=head_dim,
              qk_norm=True, kv_fp8=kv_fp8, rotary_dim=rotary_dim, unit_offset=True)


# rows 1-4 (the GEMV), odd N and K (masked tiles), a bias; tiles: the dispatcher's choice, and
# explicit tiles that split K into several steps
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, n, k, bias, tiles", [
    (1, 96, 64, False, None), (3, 37, 100, True, None), (4, 64, 256, False, (4, 64, 4)),
    (2, 130, 48, True, (16, 32, 4)), (9, 40, 64, False, None),
    # the row's steps written out (unroll): 2 masked, 3 masked, 4 whole
    (1, 37, 100, True, (2, 64, 4, 1, False, True)), (1, 33, 300, False, (2, 128, 4, 1, False, True)),
    (1, 40, 256, True, (1, 64, 4, 1, False, True))])
def test_linear(run_check, dtype, rows, n, k, bias, tiles):
    if dtype == torch.float32 and tiles is not None:
        tiles = None  # float32 always goes to cuBLAS; checked through the dispatcher
    run_check(check_linear, dtype=dtype, rows=rows, n=n, k=k, bias=bias, tiles=tiles)


def test_gemv_rules():
    """Every rule gives power-of-two tiles (steps of at most 4096 inputs, or the row's own power of
    two) at the presets' shapes and odd ones; using_gemv_rule switches and restores, and refuses a
    rule it does not have."""
    triton_matmul = _triton_module("matmul")
    shapes = [(1024, 2048), (4096, 1024), (5120, 2880), (200064, 3072), (4096, 12288), (30720, 3840), (37, 100)]
    for name in triton_matmul.GEMV_RULES:
        with triton_matmul.using_gemv_rule(name):
            for n, k in shapes:
                block_n, block_k, warps = triton_matmul.gemv_config(1, n, k)
                assert block_k & (block_k - 1) == 0 and block_n & (block_n - 1) == 0 and warps in (1, 2, 4, 8, 16)
                assert block_k <= max(4096, triton_matmul.triton.next_power_of_2(k))
    default = triton_matmul.gemv_config(1, 5120, 2880)
    with triton_matmul.using_gemv_rule("whole_rows"):
        assert triton_matmul.gemv_config(1, 5120, 2880) == (2, 4096, 4)
    assert triton_matmul.gemv_config(1, 5120, 2880) == default
    with pytest.raises(ValueError, match="no GEMV rule"):
        with triton_matmul.using_gemv_rule("fastest"):
            pass


# one row (the dispatcher folds: the default policy takes these widths), odd N and K (masked
# tiles), the first layer's norm without a residual, K in several steps (the statistic in a first
# pass; the last step masked or not), a few rows through the kernel, and rows the dispatcher
# leaves to the separate kernels
NORM_LINEAR_CASES = [(1, 96, 64, False, True, None), (1, 37, 100, True, True, None),
                     (1, 33, 100, True, False, None), (1, 130, 300, False, True, (2, 128, 4)),
                     (1, 64, 256, True, False, (4, 64, 4)), (3, 40, 96, True, True, (4, 128, 4)),
                     (4, 40, 64, False, True, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, n, k, bias, residual, tiles", NORM_LINEAR_CASES,
                         ids=[f"rows{c[0]}-n{c[1]}-k{c[2]}" + ("-bias" if c[3] else "")
                              + ("-residual" if c[4] else "") + ("-tiles" if c[5] else "")
                              for c in NORM_LINEAR_CASES])
def test_rms_norm_linear(run_check, dtype, rows, n, k, bias, residual, tiles):
    if dtype == torch.float32:
        tiles = None  # float32 takes the separate kernels; checked through the dispatcher
    run_check(check_rms_norm_linear, dtype=dtype, rows=rows, n=n, k=k, bias=bias,
              residual=residual, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows, n, k, bias, residual, tiles", [NORM_LINEAR_CASES[i] for i in (0, 2, 3, 5)],
                         ids=["one-tile", "no-residual", "steps", "rows"])
def test_rms_norm_linear_unit_offset(run_check, dtype, rows, n, k, bias, residual, tiles):
    """Gemma's and Qwen3.5's norm (by 1 + weight) folded into the GEMV: as the separate kernels."""
    run_check(check_rms_norm_linear, dtype=dtype, rows=rows, n=n, k=k, bias=bias,
              residual=residual, tiles=tiles, unit_offset=True)


SILU_LINEAR_CASES = [(1, 96, 64, False, None), (1, 37, 100, True, None), (1, 40, 300, True, (2, 128, 4)),
                     (3, 33, 96, False, (4, 32, 4)), (2, 40, 64, False, None),
                     (1, 20, 4500, True, None),  # K > 4096: silu_gemv_config's 2048-wide steps, the last masked
                     (1, 24, 300, True, (2, 128, 4, True))]  # the steps written out (unroll), the last masked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, n, k, bias, tiles", SILU_LINEAR_CASES,
                         ids=[f"rows{c[0]}-n{c[1]}-k{c[2]}" + ("-bias" if c[3] else "")
                              + ("-tiles" if c[4] else "") for c in SILU_LINEAR_CASES])
def test_silu_and_mul_linear(run_check, dtype, rows, n, k, bias, tiles):
    if dtype == torch.float32:
        tiles = None
    run_check(check_silu_and_mul_linear, dtype=dtype, rows=rows, n=n, k=k, bias=bias, tiles=tiles)


# (rows, n, k, bias, tiles, glu, normed): one row through the dispatcher (plain and after the
# folded norm), an odd n (forced tiles of 8 and 4 rows: the last program's features masked), forced tiles of two and four
# rows, the steps written out, K > 4096 (steps of 4096, the last masked), three rows through the
# kernel, and two rows the dispatcher leaves to F.linear and the separate activation
GLU_CASES = [(1, 48, 64, False, None, "silu", False), (1, 37, 100, True, None, "silu", False),
             (1, 37, 100, True, (8, 64, 4), "gelu_tanh", True), (1, 37, 64, False, (4, 64, 4), "silu", False),
             (1, 36, 64, True, None, "gelu_tanh", True), (1, 33, 96, False, (2, 32, 4), "silu", True),
             (1, 40, 300, True, (4, 128, 4), "gelu_tanh", False), (1, 24, 300, True, (2, 128, 4, True), "silu", False),
             (1, 20, 4500, False, None, "gelu_tanh", False), (3, 24, 64, True, (4, 64, 4), "silu", False),
             (2, 40, 64, False, None, "silu", True)]


# the default run takes the cases in pairs of one dtype, alternating: silu and tanh gelu, plain and
# normed, forced tiles and the dispatcher's each in both; the whole product with -m slow
@thinned("rows, n, k, bias, tiles, glu, normed, dtype", lambda case, dtype: dtype == case // 2 % 2,
         [pytest.param(*c, id=f"rows{c[0]}-n{c[1]}-k{c[2]}-{c[5]}" + ("-bias" if c[3] else "")
                       + ("-tiles" if c[4] else "") + ("-normed" if c[6] else "")) for c in GLU_CASES],
         [torch.bfloat16, torch.float16])
def test_linear_glu(run_check, rows, n, k, bias, tiles, glu, normed, dtype):
    run_check(check_linear_glu, dtype=dtype, rows=rows, n=n, k=k, bias=bias, tiles=tiles, glu=glu, normed=normed)


def test_glu_dispatch(run_check):
    run_check(check_glu_dispatch)


def test_the_glu_epilogue_takes_the_widths_it_was_measured_to_win():
    """AUTO: silu in the gate/up GEMV from where the down GEMV stops taking it up to 8192 features
    (phi4-mini gained, qwen3-8b's 12288 lost), tanh gelu at every width (its separate path is two
    torch launches); OFF never."""
    auto = fusion.AUTO
    assert [auto.glu_linear(n, "silu") for n in (3072, auto.silu_max_k, auto.silu_max_k + 1, 8192, 12288)] == \
        [False, False, True, True, False]
    assert auto.glu_linear(15360, "gelu_tanh") and not fusion.OFF.glu_linear(15360, "gelu_tanh")
    assert not fusion.OFF.glu_linear(8192, "silu")
    with pytest.raises(ValueError, match="relu"):
        auto.glu_linear(8192, "relu")


def test_fusion_dispatch(run_check):
    run_check(check_fusion_dispatch)


# The dispatcher's choice over the row counts of decode (GEMV: 1, 2), verify (5, 17) and prefill
# chunks (GEMM: 64, 130 as [2, 65]); odd N (masked programs), K a multiple of the group but not of
# the K tile (a masked last step), every group size, with and without bias
QUANT_CASES = [((1,), 33, 96, 32, False), ((2,), 257, 192, 64, True), ((5,), 40, 384, 128, False),
               ((17,), 33, 160, 32, True), ((4, 5), 300, 256, 128, True), ((64,), 257, 192, 64, False),
               ((2, 65), 70, 384, 128, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
@pytest.mark.parametrize("lead, n, k, group_size, bias", QUANT_CASES,
                         ids=[f"rows{math.prod(c[0])}-n{c[1]}-k{c[2]}-g{c[3]}" for c in QUANT_CASES])
def test_linear_quant(run_check, dtype, bits, lead, n, k, group_size, bias):
    run_check(check_linear_quant, dtype=dtype, bits=bits, lead=lead, n=n, k=k,
              group_size=group_size, bias=bias, tiles=None)


# each kernel outside the dispatcher's range and with K in several steps: the GEMV over 3 and 9
# rows in 128- and 64-wide steps (int8's K=200: the last one masked), the GEMM over one row
# and over 5 in two pipelined steps; float16 here only
QUANT_TILE_CASES = [
    (4, 3, 37, 384, 128, "gemv", (4, 128, 4)), (8, 9, 37, 200, 1, "gemv", (2, 64, 4)),
    (4, 1, 40, 96, 32, "gemm", (16, 32, 32, 4, 1)), (8, 5, 33, 192, 1, "gemm", (16, 32, 64, 4, 2)),
    # the GEMVs with two int4 groups a step and a masked last step, int4 groups of 8 and 16
    # (a word and two), int8 in steps of 128 over K=200
    (4, 2, 37, 384, 64, "gemv", (16, 128, 4)), (4, 1, 70, 96, 32, "gemv", (32, 64, 2)),
    (4, 4, 19, 48, 8, "gemv", (8, 16, 1)), (4, 1, 33, 64, 16, "gemv", (4, 64, 4)),
    (8, 1, 65, 200, 1, "gemv", (16, 128, 4)),
    # the int4 GEMV's vector-input variant (x_vector): groups of 128 in two steps, of 8, of 16
    (4, 3, 37, 384, 128, "gemv", (4, 128, 4, True)), (4, 4, 19, 48, 8, "gemv", (8, 16, 1, True)),
    (4, 1, 33, 64, 16, "gemv", (4, 64, 4, True)),
    # int4 on tensor cores: K split over programs (3 groups in 3, 8 in 4, uneven: 5 in 2 of 3 and
    # 2), masked output features, 16 rows (one tile of rows) and 17 (two, split)
    (4, 1, 37, 384, 128, "dot", (16, 3, 4, 2)), (4, 3, 70, 256, 32, "dot", (32, 4, 4, 3)),
    (4, 2, 24, 320, 64, "dot", (16, 2, 4, 1)), (4, 16, 33, 128, 64, "dot", (64, 1, 4, 1)),
    (4, 17, 20, 64, 32, "dot", (16, 2, 4, 2)),
    # the same with the codes as int32 words (eight dots a group): split 3 in 3, 4 in 2 with
    # masked features, groups of 256 over 17 rows
    (4, 1, 37, 384, 128, "dot", (16, 3, 4, 2, True)), (4, 3, 70, 512, 128, "dot", (32, 2, 4, 3, True)),
    (4, 17, 20, 512, 256, "dot", (16, 2, 4, 1, True)), (4, 2, 24, 640, 128, "dot", (16, 2, 4, 1, True)),
    # and with x, scales and zeros loaded a group ahead (PREFETCH): one group a split, uneven splits
    (4, 1, 37, 384, 128, "dot", (16, 3, 4, 2, True, True)), (4, 3, 70, 640, 128, "dot", (32, 2, 4, 3, True, True)),
    (4, 17, 20, 512, 256, "dot", (16, 1, 4, 1, True, True)),
    # 32 and 64 rows a program (batch and verify steps): 33 rows in two, both kernels; 70 in two
    # of 64 with PREFETCH
    (4, 33, 20, 256, 128, "dot", (16, 2, 4, 2, True, False, 32)), (4, 33, 24, 128, 32, "dot", (16, 1, 4, 2, False, False, 32)),
    (4, 70, 20, 384, 128, "dot", (16, 2, 4, 2, True, True, 64))]


# the default run alternates the dtype along the cases: each kernel and variant above runs in both;
# the whole product with -m slow
@thinned("bits, rows, n, k, group_size, kernel, tiles, dtype", lambda case, dtype: dtype == case % 2,
         QUANT_TILE_CASES, [torch.bfloat16, torch.float16])
def test_linear_quant_tiles(run_check, bits, rows, n, k, group_size, kernel, tiles, dtype):
    run_check(check_linear_quant, dtype=dtype, bits=bits, lead=(rows,), n=n, k=k,
              group_size=group_size, bias=True, tiles=(kernel, tiles))


def check_a8(device, dtype, bits, rows, n, k, group_size, tiles, outlier):
    """The x int8 GEMV (int4 or int8 weights) against its reference (x rounded to int8 a block of
    32, the product in float64); x's codes and d against the reference's; and the whole against
    the exact product, within what rounding x to 8 bits costs."""
    quant_triton = _triton_module("quant")
    gen = torch.Generator().manual_seed(n + k + rows + bits)
    qweight, scales, zeros = (t if t is None else t.to(device) for t in make_quant_weight(bits, n, k, group_size, gen))
    x = torch.randn(rows, k, generator=gen)
    x[:, 1:k // 2 + 1] = 0  # all-zero blocks (d = 0)
    x[0, -1] = outlier  # one large column: its block's other codes coarse, the others' unaffected
    x = x.to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device)
    tiles = quant_triton.A8GemvTiles(*tiles)
    if bits == 4:
        out = quant_triton.linear_int4_launch(x, qweight, scales, zeros, group_size, b, tiles)
        exact = quant.linear_int4(x.double(), qweight, scales, zeros, group_size, b.double())
    else:
        out = quant_triton.linear_int8_launch(x, qweight, scales, b, tiles)
        exact = quant.linear_int8(x.double(), qweight, scales, b.double())
    ref = quant.reference_a8(x, qweight, scales, zeros, group_size, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02
    q, d = quant_triton.quantize_a8(x, quant_triton.A8_PAIRS if bits == 4 else quant_triton.A8_COLUMNS)
    codes, d_ref = quant.reference_quantize_a8(x)
    words = q.view(rows, k // 32, 2, 4).cpu()  # block, half, word
    unpacked = torch.stack([(words << (24 - 8 * j)) >> 24 for j in range(4)], dim=-1)  # sign-extended bytes
    # int4: byte j of word w of half h is column 8w + 2j + h of its block; int8: column 16h + 4w + j
    order = (0, 1, 3, 4, 2) if bits == 4 else (0, 1, 2, 3, 4)
    kernel_codes = unpacked.permute(*order).reshape(rows, k)
    off = kernel_codes - codes.long().cpu()
    # x * (127 / max) within an ulp of a half: the two sides' 127 / max may round apart
    assert off.abs().max() <= 1 and (off != 0).sum() <= 2, off.nonzero()
    torch.testing.assert_close(d[..., 0], d_ref)
    torch.testing.assert_close(d[..., 1].cpu(), d_ref.cpu() * kernel_codes.view(rows, k // 32, 32).float().sum(-1))


def check_a8_nan(device, bits):
    """A NaN in x gives NaN outputs from the x int8 GEMV as from the 16-bit kernels (its block's d
    is NaN), not the finite product of a clamped code; the other row is untouched."""
    quant_triton = _triton_module("quant")
    gen = torch.Generator().manual_seed(5)
    qweight, scales, zeros = (t if t is None else t.to(device) for t in make_quant_weight(bits, 20, 128, 32, gen))
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    x[0, 40] = float("nan")
    x = x.to(device)
    tiles = quant_triton.A8GemvTiles(2, 256, 2, 1, 2)
    out = (quant_triton.linear_int4_launch(x, qweight, scales, zeros, 32, None, tiles) if bits == 4 else
           quant_triton.linear_int8_launch(x, qweight, scales, None, tiles))
    assert out[0].isnan().all() and not out[1].isnan().any()


@pytest.mark.parametrize("bits", [4, 8])
def test_a8_nan(run_check, bits):
    run_check(check_a8_nan, bits=bits)


def check_a8_folds(device, bits, residual, style, k=320):
    """The norm's and SiLU-and-mul's launches that also write x's int8 codes (`rms_norm_a8`,
    `silu_and_mul_a8`): their outputs equal the plain kernels', their codes equal `quantize_a8` of
    those outputs, and `linear_a8` of the codes equals the linear layer through its x int8 GEMV.
    k = 1312: 41 blocks of 32, over three norm programs and two SiLU ones, the last of each short."""
    import hibana_kernels.activation_triton as act
    import hibana_kernels.norm_triton as nt

    quant_triton = _triton_module("quant")
    gen = torch.Generator().manual_seed(11 + bits)
    n, order = 37, quant.A8_PAIRS if bits == 4 else quant.A8_COLUMNS
    x, r = (torch.randn(2, k, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    w = (1 + torch.randn(k, generator=gen) / 4).to(torch.bfloat16).to(device)
    unit_offset, cast_last = NORM_STYLES[style]
    normed, res_out, q, d = nt.rms_norm_a8(x, r if residual else None, w, 1e-6, unit_offset, order, cast_last)
    want = (nt.fused_add_rms_norm(x, r, w, 1e-6, unit_offset, cast_last) if residual
            else (nt.rms_norm(x, w, 1e-6, unit_offset, cast_last), x))
    assert torch.equal(normed, want[0]) and torch.equal(res_out, want[1])
    q_ref, d_ref = quant_triton.quantize_a8(normed, order)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    gate_up = torch.randn(2, 2 * k, generator=gen).to(torch.bfloat16).to(device)
    product, q2, d2 = act.silu_and_mul_a8(gate_up, order)
    assert torch.equal(product, act.silu_and_mul(gate_up))
    q2_ref, d2_ref = quant_triton.quantize_a8(product, order)
    assert torch.equal(q2, q2_ref) and torch.equal(d2, d2_ref)
    qweight, scales, zeros = (t if t is None else t.to(device) for t in make_quant_weight(bits, n, k, 32, gen))
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    a8_rows, quant_triton.A8_MAX_ROWS = quant_triton.A8_MAX_ROWS, 2
    try:
        out = quant_triton.linear_a8(q, d, (2,), torch.bfloat16, qweight, scales, zeros, 32 if bits == 4 else 1, b)
        direct = (quant_triton.linear_int4(normed, qweight, scales, zeros, 32, b) if bits == 4 else
                  quant_triton.linear_int8(normed, qweight, scales, b))
    finally:
        quant_triton.A8_MAX_ROWS = a8_rows
    assert torch.equal(out, direct)


@pytest.mark.parametrize("bits, residual, style, k", [(4, True, "llama", 320), (8, False, "gemma", 320),
                                                     (4, True, "llama", 1312), (8, True, "gpt_oss", 1312)])
def test_a8_folds(run_check, bits, residual, style, k):
    run_check(check_a8_folds, bits=bits, residual=residual, style=style, k=k)


# the x int8 GEMV (block_n, block_k, warps[, stages, block_m]): K in one step, in several with a masked last one (K 384
# in steps of 256), int4 groups of 32 (a step spanning several) and of 128 over steps narrower than
# a group, odd N, per-channel int4 (one group of K); int8 likewise; one to three rows, an outlier
# in x and none
A8_CASES = [
    (4, 1, 37, 256, 128, (4, 256, 4), 0.0), (4, 1, 37, 384, 128, (2, 256, 2), 40.0),
    (4, 3, 33, 384, 32, (8, 128, 4), 8.0), (4, 1, 70, 512, 128, (4, 64, 2), 0.0), (4, 2, 19, 96, 32, (1, 1024, 4), 40.0),
    (4, 1, 20, 256, 256, (2, 128, 2, 2), 0.0),
    (8, 1, 37, 384, 1, (2, 256, 2), 40.0), (8, 2, 33, 96, 1, (4, 1024, 4), 0.0), (8, 1, 70, 512, 1, (8, 64, 2, 2), 8.0),
    # several rows a program (block_m): 3 rows in a tile of 4, 5 in tiles of 2 (the last masked)
    (4, 3, 37, 384, 128, (2, 256, 2, 1, 4), 40.0), (4, 5, 33, 256, 32, (4, 128, 4, 2, 2), 0.0),
    (8, 3, 37, 384, 1, (2, 256, 2, 1, 4), 8.0)]


# the default run alternates the dtype along the cases: int4 and int8, one row a program and
# several, each in both; the whole product with -m slow
@thinned("bits, rows, n, k, group_size, tiles, outlier, dtype", lambda case, dtype: dtype == case % 2,
         A8_CASES, [torch.bfloat16, torch.float16])
def test_a8(run_check, bits, rows, n, k, group_size, tiles, outlier, dtype):
    run_check(check_a8, dtype=dtype, bits=bits, rows=rows, n=n, k=k, group_size=group_size, tiles=tiles,
              outlier=outlier)


# fp8 through the dispatcher at the row counts of decode (GEMV: 1, 3), verify and prefill chunks
# (GEMM: 5, 17, 130 as [2, 65]) and from 128 rows (dequantize + F.linear); blocks as checkpoints
# have them (128x128 over a K of 200: a partial block), blocks that divide neither N nor K (and
# a width bk that is not a power of two: sub-tiles of its largest power-of-two factor), per
# output channel (1, K), per tensor (N, K), and per row with bk narrower than a tile (fused
# layers whose parts do not align with the blocks)
FP8_CASES = [((1,), 33, 96, (16, 32), False), ((3,), 37, 200, (128, 128), True),
             ((5,), 40, 100, (24, 24), False), ((17,), 33, 160, (1, 160), True),
             ((2, 65), 70, 64, (70, 64), True), ((1,), 65, 192, (1, 64), False),
             ((130,), 24, 48, (5, 12), True)]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("lead, n, k, block, bias", FP8_CASES,
                         ids=[f"rows{math.prod(c[0])}-n{c[1]}-k{c[2]}-b{c[3][0]}x{c[3][1]}" for c in FP8_CASES])
def test_linear_fp8(run_check, dtype, lead, n, k, block, bias):
    run_check(check_linear_fp8, dtype=dtype, lead=lead, n=n, k=k, block=block, bias=bias, tiles=None)


# each path outside the dispatcher's range, K in several steps: the GEMV over 9 rows in 64-wide
# steps (two 32-wide blocks a step, and one 128-wide block over two steps), the GEMM over one row
# and in several pipelined steps, dequantize + F.linear over 3 rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, n, k, block, kernel, tiles", [
    (9, 37, 200, (16, 32), "gemv", (8, 64, 4)), (2, 33, 256, (128, 128), "gemv", (16, 64, 2)),
    (1, 40, 96, (8, 16), "gemm", (16, 32, 32, 4, 1)), (5, 33, 192, (128, 128), "gemm", (16, 32, 64, 4, 2)),
    (6, 20, 72, (1, 72), "gemm", (16, 16, 32, 4, 2)), (3, 24, 80, (7, 10), "dequantize", ())])
def test_linear_fp8_tiles(run_check, dtype, rows, n, k, block, kernel, tiles):
    run_check(check_linear_fp8, dtype=dtype, lead=(rows,), n=n, k=k, block=block, bias=True,
              tiles=(kernel, tiles))


def test_pdl_launches_only_where_it_may(monkeypatch):
    """Programmatic dependent launch is off on the CPU (the interpreter has no grid dependency
    control) and wherever `pdl.using` turns it off; on a device that has it, it follows the kind of
    kernel and leaves GEMV grids above MAX_PROGRAMS to launch plainly. (On the GPU every kernel
    test above runs with it.)"""
    from hibana_kernels import pdl

    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert pdl.enabled(cuda) and pdl.enabled(cuda, "gemv", pdl.MAX_PROGRAMS)
    assert not pdl.enabled(cuda, "gemv", pdl.MAX_PROGRAMS + 1)
    with pdl.using(True, kinds=("attention",), max_programs=None):
        assert pdl.enabled(cuda, "attention") and not pdl.enabled(cuda, "gemv", 1)
        with pdl.using(False):
            assert pdl.launch_args(cuda, "attention") == {"PDL": False, "launch_pdl": False}
        assert pdl.enabled(cuda, "attention")
    assert pdl.enabled(cuda, "moe") and not pdl.enabled(cuda, "gemv", 10**6)  # the defaults again
