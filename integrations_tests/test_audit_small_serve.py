"""Small defects audited: `hibana serve` stopped by Ctrl+C twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

LONG_LIST = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
    "type": "array", "items": {"type": "integer"}, "minItems": 300}}}  # 600 tokens at least


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_ctrl_c_while_a_request_streams_stops_quietly():
    """Ctrl+C while a reply streams starts the graceful shutdown, which waits for it ("CTRL+C to
    force quit", uvicorn says); a second Ctrl+C left the request and the lifespan to asyncio.run's
    cancelling, each logged as an ERROR traceback. It ends the requests in flight now, as the
    shutdown timeout does (the stream's last event an error), and the server stops quietly."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hibana_plugins.server import main; sys.exit(main(sys.argv[1:]))",
         "demo", "--port", str(port), "--log-level", "info"], env=os.environ, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    waiting = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if "Waiting for connections to close" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.2)
        body = {"model": "demo", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 1500,
                "stream": True, "response_format": LONG_LIST}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as reply:
            events = reply.iter_lines()
            assert next(line for line in events if line.startswith("data: {"))  # streaming
            process.send_signal(signal.SIGINT)
            assert waiting.wait(30), "".join(lines)  # the graceful shutdown waits for the stream
            process.send_signal(signal.SIGINT)
            last = [line for line in events if line.startswith("data: {")][-1]
        assert json.loads(last[6:])["error"]["code"] == "server_shutting_down"
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    text = "".join(lines)
    assert "Traceback" not in text and "ERROR" not in text, text
