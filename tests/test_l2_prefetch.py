"""The L2 prefetch experiment (`hibana_kernels.l2_prefetch`): its settings, the plan of what is
asked for when, that it launches nothing outside a CUDA capture, and that its kernel compiles
for sm_90 to the PTX prefetch instructions it is meant to issue."""

from __future__ import annotations

import re

import pytest
import torch

from hibana_kernels import l2_prefetch


def test_settings_parse():
    assert l2_prefetch.parse(None) is None and l2_prefetch.parse("off") is None and l2_prefetch.parse("0") is None
    assert l2_prefetch.parse("lines") == l2_prefetch.Settings(bulk=False)
    chosen = l2_prefetch.parse("bulk:8:4:32")
    assert (chosen.bulk, chosen.max_bytes, chosen.programs, chosen.unit) == (True, 8 << 20, 4, 32 << 10)
    with pytest.raises(ValueError, match="lines' or 'bulk"):
        l2_prefetch.parse("everything")


def test_settings_refuse_what_the_kernel_cannot_take():
    for bad, says in (("bulk:1:2:0.01", "multiple of 16"), ("lines:inf", "finite"), ("lines:1:2:64", "lines[:MB"),
                      ("bulk:x", "numbers"), ("lines:0", "above 0")):
        with pytest.raises(ValueError, match=re.escape(says)):
            l2_prefetch.parse(bad)


def test_plan_learns_the_order_the_step_runs_its_projections(tiny_checkpoints, make_engine, monkeypatch):
    """The first forward of a session teaches the plan which projection follows which (the step's
    own order, whatever the family); a CPU engine's DecodeGraphs runs one here."""
    from hibana_core.runner import DecodeGraphs

    engine = make_engine(tiny_checkpoints["qwen2"], speculation="off")
    graphs = DecodeGraphs(engine.core.runner, 1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    plan = l2_prefetch.Plan()
    with l2_prefetch.using(l2_prefetch.Settings()):
        with l2_prefetch.session(plan, torch.device("cuda")) as active:  # learning: nothing launched
            assert active is None
            graphs._forward(1, 1, 256)
    model = engine.model
    expected = [None]
    for layer in model.model.layers:
        expected += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    expected.append(model.lm_head)
    assert plan.next == {id(a): b for a, b in zip(expected, expected[1:])}
    assert all(not isinstance(v, torch.Tensor) for v in plan.next.values())  # modules, not their tensors
    assert model.model.layers[0].self_attn.qkv_proj.read_tensors()[-1] is model.model.layers[0].self_attn.qkv_proj.bias


def test_nothing_is_launched_on_the_cpu(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    plan = l2_prefetch.Plan()
    with l2_prefetch.using(l2_prefetch.Settings()):
        with l2_prefetch.session(plan, torch.device("cpu")) as active:
            assert active is None
            l2_prefetch.ahead(engine.model.lm_head)  # no session: a no-op, not an error
    assert plan.next is None


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
