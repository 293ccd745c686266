"""Small defects audited: rotary tables built or counted before the engine sizes them (the surgery
guard's forwards, a draft model's planned bytes)."""

from __future__ import annotations

import pytest

from hibana_core.models import decoder


@pytest.fixture(scope="module")
def long_config(tmp_path_factory):
    """A tiny qwen3 checkpoint whose config claims 2**18 positions."""
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("long") / "qwen3", max_position_embeddings=1 << 18)


def test_the_surgery_guard_builds_rotary_tables_of_the_engines_size(long_config, tmp_path, make_engine, monkeypatch):
    """The guard (and calibration) ran their forwards before `size_rotary`, on tables of the
    config's max_position_embeddings rows: 1M positions cost ~1 GB there however short the
    engine's max_model_len. Every table is now built at the rows the engine addresses."""
    path = long_config
    built = []
    build = decoder.RotaryTables._build

    def recorded(self, device):
        built.append(self.max_positions)
        build(self, device)

    text = tmp_path / "short.txt"  # a short held-out text: the guard's forwards, quickly
    text.write_text("the user's own held-out text, repeated " * 20)
    monkeypatch.setattr(decoder.RotaryTables, "_build", recorded)
    engine = make_engine(path, surgery=[{"name": "w8", "force": True}], speculation="off", max_model_len=2048,
                         surgery_guard_text=str(text))
    assert engine.surgery[0]["guard"]["tokens"] > 100  # the guard ran
    assert built and max(built) == decoder.MIN_ROTARY_POSITIONS  # rotary_positions(2048, ...): 4,096 rows


def test_a_planned_draft_model_counts_the_rotary_rows_it_will_build(long_config):
    """`planned_model` (a memory budget's reserve for a draft model) counted rotary tables of
    max_position_embeddings rows, where the drafter sizes them to the engine's max_model_len
    (`size_rotary`): a 1M-position config's ~1 GB reserved for 4,096 rows' MiBs."""
    import torch

    from hibana_core import loader

    path = long_config
    full, args = loader.planned_model(str(path), torch.float32)
    short, _ = loader.planned_model(str(path), torch.float32, max_model_len=2048)
    module, _ = loader._built_on_meta("qwen3", loader.family_of("qwen3"), loader.read_config(path, "qwen3"),
                                      loader.ForwardContext())
    weights = loader.model_bytes(module.to(dtype=torch.float32))
    decoder.size_rotary(module, decoder.rotary_positions(2048, args))
    assert short == weights + decoder.rotary_bytes(module) < full
    assert decoder.rotary_bytes(module) == 2 * decoder.MIN_ROTARY_POSITIONS * args.head_dim * 4
