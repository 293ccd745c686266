"""Small defects audited: the rotary tables built before the engine sizes them (surgery guard)."""

from __future__ import annotations

from hibana_core.models import decoder


def test_the_surgery_guard_builds_rotary_tables_of_the_engines_size(tmp_path, make_engine, monkeypatch):
    """The guard (and calibration) ran their forwards before `size_rotary`, on tables of the
    config's max_position_embeddings rows: 1M positions cost ~1 GB there however short the
    engine's max_model_len. Every table is now built at the rows the engine addresses."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3", tmp_path / "long", max_position_embeddings=1 << 18)
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
