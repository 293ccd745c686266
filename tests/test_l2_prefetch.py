"""The L2 prefetch experiment (`hibana_kernels.l2_prefetch`): its settings, the plan of what is
asked for when, that it launches nothing outside a CUDA capture, and that its kernel compiles
for sm_90 to the PTX prefetch instructions it is meant to issue."""

from __future__ import annotations

import pytest
import torch

from hibana_core import Engine
from hibana_kernels import l2_prefetch


def test_settings_parse():
    assert l2_prefetch.parse(None) is None and l2_prefetch.parse("off") is None and l2_prefetch.parse("0") is None
    assert l2_prefetch.parse("lines") == l2_prefetch.Settings(bulk=False)
    chosen = l2_prefetch.parse("bulk:8:4:32")
    assert (chosen.bulk, chosen.max_bytes, chosen.programs, chosen.unit) == (True, 8 << 20, 4, 32 << 10)
    with pytest.raises(ValueError, match="lines' or 'bulk"):
        l2_prefetch.parse("everything")


@pytest.fixture(scope="module")
def demo_model():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off") as engine:
        yield engine.model


def test_plan_asks_for_the_next_projection_in_step_order(demo_model):
    layers = [m for m in demo_model.modules() if hasattr(m, "read_tensors")]
    plan = l2_prefetch.plan_of(layers, lambda m: m.read_tensors())
    first = demo_model.model.layers[0]
    attn, mlp = first.self_attn, first.mlp
    assert plan.next[id(None)][0] is attn.qkv_proj.weight  # asked for as the step starts
    assert plan.next[id(attn.qkv_proj)][0] is attn.o_proj.weight
    assert plan.next[id(attn.o_proj)][0] is mlp.gate_up_proj.weight
    assert plan.next[id(mlp.gate_up_proj)][0] is mlp.down_proj.weight
    assert plan.next[id(mlp.down_proj)][0] is demo_model.model.layers[1].self_attn.qkv_proj.weight
    last = demo_model.model.layers[-1].mlp.down_proj
    assert plan.next[id(last)][0] is demo_model.lm_head.weight
    assert id(demo_model.lm_head) not in plan.next  # nothing after the head


def test_nothing_is_launched_outside_a_cuda_capture(demo_model, monkeypatch):
    layers = [m for m in demo_model.modules() if hasattr(m, "read_tensors")]
    plan = l2_prefetch.plan_of(layers, lambda m: m.read_tensors())
    with l2_prefetch.using(l2_prefetch.Settings()):
        with l2_prefetch.session(plan, torch.device("cpu")) as active:
            assert active is None
            l2_prefetch.ahead(layers[0])  # no session: a no-op, not an error
    assert l2_prefetch.settings() is None or l2_prefetch.settings() == l2_prefetch.parse(
        __import__("os").environ.get("HIBANA_L2_PREFETCH"))


@pytest.mark.parametrize("bulk", [False, True], ids=["lines", "bulk"])
def test_kernel_compiles_to_prefetches_for_sm90(bulk):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hibana_kernels import l2_prefetch_triton as lt

    source = ASTSource(fn=lt._l2_prefetch_kernel, signature={"base_ptr": "*u8", "n_units": "i32", "UNIT": "constexpr",
                                                              "BLOCK": "constexpr", "BULK": "constexpr"},
                       constexprs={"UNIT": 65536 if bulk else 128, "BLOCK": 128 if bulk else 1024, "BULK": bulk})
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - a Triton without the NVIDIA backend or its ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    wanted = "cp.async.bulk.prefetch.L2.global" if bulk else "prefetch.global.L2::evict_last"
    assert ptx.count(wanted) >= 1
    assert "st.global" not in ptx  # asks, writes nothing
