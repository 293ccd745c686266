"""The bounded load test of `hibana serve` (issue 19), small: a few clients in tool loops over HTTP
on 127.0.0.1 against the same conversations in process (`hibana bench serve` runs it at 64 x 20)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hibana_bench.serve_load import ServeLoadConfig, serve_load  # noqa: E402
from hibana_core import Engine  # noqa: E402


def test_clients_in_tool_loops_over_http_get_the_in_process_conversations():
    cfg = ServeLoadConfig(clients=3, turns=4)
    report = serve_load(lambda: Engine.from_pretrained("demo", progress=False), "demo", cfg)
    assert report["errors"] == []
    assert report["mismatched_clients"] == [], report["differences"]
    assert report["leaked_blocks"] == {"in_process": 0, "server": 0}
    for result in report["results"].values():
        assert result["turns"] == cfg.clients * cfg.turns
        assert 0 < result["ttft_p50_s"] <= result["ttft_p95_s"] <= result["seconds"]
