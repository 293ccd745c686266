"""The bounded load test of `hibana serve` (issue 19), small: a few clients in tool loops over HTTP
on 127.0.0.1 against the same conversations in process (`hibana bench serve` runs it at 64 x 20)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hibana_bench.serve_load import ServeLoadConfig, serve_load  # noqa: E402
from hibana_core import Engine  # noqa: E402


@pytest.mark.parametrize("client_processes", [1, 2])
def test_clients_in_tool_loops_over_http_get_the_in_process_conversations(client_processes):
    cfg = ServeLoadConfig(clients=3, turns=4, client_processes=client_processes)
    report = serve_load(lambda: Engine.from_pretrained("demo", progress=False), "demo", cfg)
    assert report["errors"] == []
    assert report["mismatched_clients"] == [], report["differences"]
    assert report["leaked_blocks"] == {"in_process": 0, "server": 0}
    for result in report["results"].values():
        assert result["turns"] == cfg.clients * cfg.turns
        assert 0 < result["ttft_p50_s"] <= result["ttft_p95_s"] <= result["seconds"]


TINY_PRESET = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                   max_position_embeddings=4096, tie_word_embeddings=False)


@pytest.mark.parametrize("dtype, checked", [("float32", True), ("bfloat16", False)])
def test_a_random_weight_preset_serves_with_the_demo_tokenizer(dtype, checked, monkeypatch, capsys):
    """`hibana bench serve --model PRESET`: the demo model's chat template on random weights, the
    vocabulary grown to the tokenizer's; equality over HTTP is a check in float32 only."""
    from hibana_bench import cli, models

    monkeypatch.setitem(models.PRESETS, "tiny-qwen3", TINY_PRESET)
    argv = ["serve", "--model", "tiny-qwen3", "--device", "cpu", "--dtype", dtype, "--clients", "2", "--turns", "2",
            "--max-tokens", "8"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "conversations equal over HTTP and in process: 2/2" in out or not checked, out
    assert ("(not checked:" in out) is not checked, out
    assert "errors" in out and "leaked" in out


def test_a_preset_vocabulary_covers_the_chat_tokenizer(monkeypatch):
    import torch

    from hibana_bench import models

    monkeypatch.setitem(models.PRESETS, "tiny-qwen3", TINY_PRESET)
    model = models.load_bench_model("tiny-qwen3", torch.device("cpu"), torch.float32, chat=True)
    assert model.vocab_size == len(model.tokenizer) > TINY_PRESET["vocab_size"]
    assert model.hf_model.config.eos_token_id == model.tokenizer.eos_token_id
    assert models.load_bench_model("tiny-qwen3", torch.device("cpu"), torch.float32).tokenizer is None
