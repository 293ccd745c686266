"""Kernel tests: the attention references against naive dense attention, and every Triton kernel
against its torch reference on random inputs.

The Triton checks run under Triton's interpreter on CPU tensors, in one worker process: the
interpreter is switched on by TRITON_INTERPRET=1, which must be set before triton is first
imported, something this process cannot promise when the whole suite runs in it (and the
variable would leak into other tests). With a GPU, the same checks also run compiled, in-process.
Shapes are small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import hibana_kernels as kernels
from hibana_kernels import activation, attention, matmul, norm, quant, rotary

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


def _exact(device, dtype):
    """Bit-exact, but the interpreter casts float32 to bfloat16 by truncation (compiled Triton,
    like torch, rounds to nearest even), so there bf16 results may differ by one unit."""
    if device == "cpu" and dtype == torch.bfloat16:
        return TOLERANCE[dtype]
    return dict(atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# inputs


def make_paged_batch(lens, num_heads, num_kv_heads, dtype, device, seed, head_dim=HEAD_DIM):
    """Random dense K/V per sequence, scattered into a NaN-filled paged cache through shuffled
    block tables (NaN: a kernel that reads a slot it should not makes the output NaN)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / BLOCK_SIZE) for s, _ in lens) + 3
    width = max(math.ceil(s / BLOCK_SIZE) for s, _ in lens) + 1  # one column of padding
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense_k, dense_v = [], [], []
    for seq_len, _ in lens:
        blocks = [perm.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        tables.append(blocks + [0] * (width - len(blocks)))
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(seq_len)])
        attention.store_kv(k, v, k_cache, v_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
    starts = [0]
    for _, query_len in lens:
        starts.append(starts[-1] + query_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=device)
    return dict(
        q=q.to(**to), k_cache=k_cache.to(**to), v_cache=v_cache.to(**to),
        block_tables=torch.tensor(tables, dtype=torch.int32, **to),
        seq_lens=torch.tensor([s for s, _ in lens], dtype=torch.int32, **to),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, **to),
        max_query_len=max(n for _, n in lens), max_seq_len=max(s for s, _ in lens),
    ), dense_k, dense_v


def naive_attention(q, dense_k, dense_v, lens, scale, window):
    """Per query row, softmax over the visible keys of its sequence, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    group = q.shape[1] // dense_k[0].shape[1]
    for (seq_len, query_len), k, v in zip(lens, dense_k, dense_v):
        k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        for p in range(seq_len - query_len, seq_len):
            j = torch.arange(seq_len)
            visible = (j <= p) & ((p - j < window) if window else True)
            s = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            s = s.masked_fill(~visible, float("-inf"))
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
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


def test_dispatch_on_cpu_runs_the_references_without_importing_triton():
    """`kernels` imports and runs on the CPU with triton never imported."""
    script = textwrap.dedent("""
        import sys, torch
        import hibana_kernels as kernels
        x = torch.randn(3, 8)
        kernels.rms_norm(x, torch.ones(8), 1e-6)
        kernels.fused_add_rms_norm(x, x, torch.ones(8), 1e-6)
        kernels.silu_and_mul(x)
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
        assert "triton" not in sys.modules, "the CPU path imported triton"
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(kernels.__file__))))


# ---------------------------------------------------------------------------------------------
# Triton kernels against the references. Each check_* runs either in the interpreter worker (CPU
# tensors) or here on CUDA tensors; it raises on a mismatch.


def _triton_module(name):
    return importlib.import_module(f"hibana_kernels.{name}_triton")


def check_paged_attention(device, group, window, lens, dtype, num_splits, head_dim=HEAD_DIM,
                          bounds_slack=0):
    """bounds_slack: pass max_query_len and max_seq_len overstated by this much (CUDA graphs)."""
    triton_attention = _triton_module("attention")
    batch, _, _ = make_paged_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, dtype, device,
                                   seed=7 * group + len(lens), head_dim=head_dim)
    scale = head_dim ** -0.5
    expected = attention.paged_attention(**batch, scale=scale, sliding_window=window)
    if bounds_slack and batch["max_query_len"] > 1:
        batch["max_query_len"] += bounds_slack
    batch["max_seq_len"] += bounds_slack
    uniform = len({n for _, n in lens}) == 1 and lens[0][1] > 1  # the decode kernel's verify mode
    if num_splits is None:  # the public entry point, choosing its own splits
        out = triton_attention.paged_attention(**batch, scale=scale, sliding_window=window,
                                               uniform_query_len=uniform)
    else:
        out = triton_attention.paged_attention_launch(
            batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
            batch["seq_lens"], batch["query_start_loc"], batch["max_query_len"], scale, window,
            num_splits, decode=uniform or None)
    assert not out.isnan().any(), "read an unwritten cache slot"
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


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


def check_norms(device, dtype, shape):
    triton_norm = _triton_module("norm")
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype).to(device)
    residual = torch.randn(*shape, generator=gen).to(dtype).to(device)
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).to(dtype).to(device)
    x_strided = torch.cat([x, x], dim=-1)[..., : shape[-1]]  # rows not contiguous
    for inp in (x, x_strided):
        torch.testing.assert_close(triton_norm.rms_norm(inp, weight, 1e-6),
                                   norm.rms_norm(inp, weight, 1e-6), **TOLERANCE[dtype])
    out, new_residual = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, **_exact(device, dtype))
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])


def rotary_tables(max_pos, head_dim, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def check_rotary(device, dtype, num_heads, head_dim):
    triton_rotary = _triton_module("rotary")
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    max_pos, tokens = 300, 11
    cos, sin = rotary_tables(max_pos, head_dim, device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
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


def check_qk_norm_rotary_store(device, dtype, num_heads, head_dim, qk_norm):
    triton_rotary = _triton_module("rotary")
    gen = torch.Generator().manual_seed(num_heads * head_dim + qk_norm)
    max_pos, tokens = 300, 7
    cos, sin = rotary_tables(max_pos, head_dim, device)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)  # q, k, v: strided views, as from the fused projection
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    weights = ()
    if qk_norm:
        weights = tuple((1 + torch.randn(head_dim, generator=gen) / 4).to(dtype).to(device)
                        for _ in range(2)) + (1e-6,)
    slots = torch.randperm(4 * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    slots[2] = -1  # a padding row: its q is still rotated, nothing is stored
    caches = [torch.full((4, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype,
                         device=device) for _ in range(4)]
    ref_q = rotary.qk_norm_rotary_store(positions, q, k, v, cos, sin, caches[0], caches[1], slots,
                                        *weights)
    out_q = triton_rotary.qk_norm_rotary_store(positions, q, k, v, cos, sin, caches[2], caches[3],
                                               slots, *weights)
    # four chained bf16 roundings, which the interpreter truncates: a few units off there
    tolerance = dict(atol=0.1, rtol=2e-2) if device == "cpu" and qk_norm else TOLERANCE[dtype]
    torch.testing.assert_close(out_q, ref_q, **tolerance)
    torch.testing.assert_close(caches[2], caches[0], equal_nan=True, **tolerance)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0, equal_nan=True)


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



def check_linear_quant(device, dtype, bits, lead, n, k, group_size, bias, tiles):
    """linear_int8 / linear_int4 against their references (in float64) on x [*lead, k]; `tiles`
    ("gemv" or "gemm", the tile sizes) forces a kernel, None lets the dispatcher pick by rows."""
    quant_triton = _triton_module("quant")
    if tiles is not None:
        kernel, sizes = tiles
        tiles = {"gemv": quant_triton.GemvTiles, "gemm": quant_triton.GemmTiles}[kernel](*sizes)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("lens, num_splits",  # None: the entry point's own choice (here: 1)
                         [(MIXED_BATCH, None), (DECODE_BATCH, None), (DECODE_BATCH, 3),
                          (VERIFY_BATCH, None), (VERIFY_BATCH, 3)],
                         ids=["mixed", "decode", "decode-3splits", "verify", "verify-3splits"])
def test_paged_attention(run_check, dtype, group, window, lens, num_splits):
    run_check(check_paged_attention, group=group, window=window, lens=lens, dtype=dtype,
              num_splits=num_splits)


# a group that is not a power of two (Qwen2.5-7B: 7), the tiny test models' head_dim 16, and a
# head_dim that is not a power of two (padded and masked)
@pytest.mark.parametrize("group, head_dim", [(7, 32), (2, 16), (2, 48)])
def test_paged_attention_odd_shapes(run_check, group, head_dim):
    for lens, num_splits in ((MIXED_BATCH, None), (DECODE_BATCH, 2)):
        run_check(check_paged_attention, group=group, window=WINDOW, lens=lens,
                  dtype=torch.float32, num_splits=num_splits, head_dim=head_dim)


@pytest.mark.parametrize("lens", [DECODE_BATCH, MIXED_BATCH], ids=["decode", "mixed"])
def test_paged_attention_with_overstated_bounds(run_check, lens):
    run_check(check_paged_attention, group=2, window=None, lens=lens, dtype=torch.float32,
              num_splits=None, bounds_slack=4000)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_store_kv(run_check, dtype):
    run_check(check_store_kv, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32), (2, 1000)], ids=str)
def test_norms(run_check, dtype, shape):
    run_check(check_norms, dtype=dtype, shape=shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, head_dim", [(4, 16), (6, 64)])
def test_rotary_embedding(run_check, dtype, num_heads, head_dim):
    run_check(check_rotary, dtype=dtype, num_heads=num_heads, head_dim=head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [96, 1500])  # 1500: more than one program per row
def test_silu_and_mul(run_check, dtype, inter):
    run_check(check_silu_and_mul, dtype=dtype, inter=inter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, head_dim", [(4, 16), (6, 64), (14, 32)])  # groups 2, 3, 7
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_qk_norm_rotary_store(run_check, dtype, num_heads, head_dim, qk_norm):
    run_check(check_qk_norm_rotary_store, dtype=dtype, num_heads=num_heads, head_dim=head_dim,
              qk_norm=qk_norm)


# rows 1-4 (the GEMV), odd N and K (masked tiles), a bias; tiles: the dispatcher's choice, and
# explicit tiles that split K into several steps
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, n, k, bias, tiles", [
    (1, 96, 64, False, None), (3, 37, 100, True, None), (4, 64, 256, False, (4, 64, 4)),
    (2, 130, 48, True, (16, 32, 4)), (9, 40, 64, False, None)])
def test_linear(run_check, dtype, rows, n, k, bias, tiles):
    if dtype == torch.float32 and tiles is not None:
        tiles = None  # float32 always goes to cuBLAS; checked through the dispatcher
    run_check(check_linear, dtype=dtype, rows=rows, n=n, k=k, bias=bias, tiles=tiles)


# The dispatcher's choice over the row counts of decode (GEMV: 1, 2), verify (5, 17) and prefill
# chunks (GEMM: 64, 130 as [2, 65]); odd N (masked programs), K a multiple of the group but not of
# the K tile (a masked last step), every group size, with and without bias
QUANT_CASES = [((1,), 33, 96, 32, False), ((2,), 257, 192, 64, True), ((5,), 40, 384, 128, False),
               ((17,), 33, 160, 32, True), ((64,), 257, 192, 64, False), ((2, 65), 70, 384, 128, True)]


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits, rows, n, k, group_size, kernel, tiles", [
    (4, 3, 37, 384, 128, "gemv", (4, 128, 4)), (8, 9, 37, 200, 1, "gemv", (2, 64, 4)),
    (4, 1, 40, 96, 32, "gemm", (16, 32, 32, 4, 1)), (8, 5, 33, 192, 1, "gemm", (16, 32, 64, 4, 2)),
    # the GEMVs with two int4 groups a step and a masked last step, int4 groups of 8 and 16
    # (a word and two), int8 in steps of 128 over K=200
    (4, 2, 37, 384, 64, "gemv", (16, 128, 4)), (4, 1, 70, 96, 32, "gemv", (32, 64, 2)),
    (4, 4, 19, 48, 8, "gemv", (8, 16, 1)), (4, 1, 33, 64, 16, "gemv", (4, 64, 4)),
    (8, 1, 65, 200, 1, "gemv", (16, 128, 4))])
def test_linear_quant_tiles(run_check, dtype, bits, rows, n, k, group_size, kernel, tiles):
    run_check(check_linear_quant, dtype=dtype, bits=bits, lead=(rows,), n=n, k=k,
              group_size=group_size, bias=True, tiles=(kernel, tiles))
