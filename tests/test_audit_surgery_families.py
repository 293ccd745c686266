"""Audit of surgery and quantized checkpoints on the families beside llama, from outside: MoE
experts (qwen3_moe, gpt_oss), interleaved sliding and global layers (gemma3), fused q/k/v and
gate/up in the checkpoint (phi3)."""

from __future__ import annotations

import logging

import pytest

from hibana_core.models.moe import StackedExperts
from tiny_models import EVERY_TENSOR_USED, make_tiny_checkpoint

pytestmark = EVERY_TENSOR_USED


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_w4_records_the_group_sizes_its_experts_took(arch, tiny_checkpoints, make_engine, caplog):
    """w4's default 128 divides neither the tiny experts' 64 hidden inputs (gate/up) nor their 32
    intermediate ones (down): the stacks took 64 and 32, while the record's group_sizes_used (and
    its warning, and `hibana surgery`'s line) named the linears' sizes alone ([64] on gpt_oss)."""
    with caplog.at_level(logging.WARNING, logger="hibana.surgery"):
        engine = make_engine(tiny_checkpoints[arch], surgery=["w4"], surgery_guard=False, speculation="off")
    record, = engine.surgery
    taken = {g for m in engine.model.modules() if isinstance(m, StackedExperts) for g in m.kernel_experts().group_sizes}
    assert taken == {64, 32}
    assert taken <= set(record["group_sizes_used"]), record["group_sizes_used"]
    assert "groups of 32, 64" in caplog.text


def test_a_window_within_a_yarn_models_context_past_its_max_position_embeddings_is_taken(make_engine, tmp_path):
    """Qwen3's long-context recipe: a YaRN rope of factor 4 over 256 positions serves 1024 while
    max_position_embeddings says 512, and the engine takes max_model_len=1024. A window of 600
    changes what its layer sees from position 604 on; it was refused as covering "all 512
    positions of this model, so the pass would change nothing"."""
    from hibana_core.errors import ConfigError

    path = make_tiny_checkpoint("qwen3", tmp_path / "yarn", max_position_embeddings=512,
                                rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                                     original_max_position_embeddings=256))
    engine = make_engine(path, max_model_len=1024, surgery=[{"name": "window", "window": 600, "layers": [1]}],
                         surgery_guard=False, speculation="off")
    assert [(g.window, g.sink_tokens) for g in engine.kv_layout.groups] == [(None, 0), (600, 4)]
    with pytest.raises(ConfigError, match=r"covers all 1024 positions of this model.*take a window under 1020"):
        make_engine(path, max_model_len=1024, surgery=[{"name": "window", "window": 1020, "layers": [1]}],
                    surgery_guard=False)
