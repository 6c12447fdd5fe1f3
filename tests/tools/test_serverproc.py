"""Starting servers side by side: ports that do not collide, and a second try when one does.

A stand-in for ``vllm-output-rate serve`` (a few lines of ``http.server`` that bind
the ``--port`` they are given) keeps these tests to a second.
"""

from __future__ import annotations

import socket
import sys
import textwrap

import httpx
import pytest

from vllm_output_rate.tools import gateway, serverproc

STAND_IN = textwrap.dedent(
    """
    import http.server, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return [sys.executable, str(script)]


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    ports = [serverproc.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < serverproc._ephemeral_floor() for p in ports)


def test_a_port_taken_before_the_server_binds_it_is_replaced(stand_in, taken_port, tmp_path, monkeypatch):
    offered = iter([taken_port])
    real = serverproc.free_port
    monkeypatch.setattr(serverproc, "free_port", lambda: next(offered, None) or real())
    with serverproc.running_server([], tmp_path, command=stand_in) as server:
        assert not server.base_url.endswith(f":{taken_port}")
        assert httpx.get(f"{server.base_url}/health", trust_env=False).status_code == 200
    assert server.proc.poll() is not None  # stopped by PID on exit
    logs = sorted(p.name for p in tmp_path.glob("server-*.log"))
    assert len(logs) == 2 and f"server-{taken_port}.log" in logs


def test_a_port_the_caller_chose_is_not_replaced(stand_in, taken_port, tmp_path):
    with pytest.raises(RuntimeError, match="could not bind its port"):
        with serverproc.running_server([], tmp_path, port=taken_port, command=stand_in):
            pass


def test_a_server_that_exits_for_another_reason_is_not_retried(tmp_path):
    failing = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(serverproc.ExitedDuringStartup, match="server exited with 3 during startup") as raised:
        with serverproc.running_server([], tmp_path, command=failing):
            pass
    assert "no model here" in str(raised.value)
    assert len(list(tmp_path.glob("server-*.log"))) == 1


# The gateway (tools/gateway.py) starts through the same wait, on its own health path.
GATEWAY_STAND_IN = textwrap.dedent(
    """
    import http.server, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class Liveliness(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health/liveliness" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Liveliness).serve_forever()
    """
)


def _executable(path, body):
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def test_the_gateway_is_ready_when_its_liveliness_path_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway, "STARTUP_TIMEOUT_S", 20)  # a wrong path fails in seconds, not minutes
    command = _executable(tmp_path / "litellm", GATEWAY_STAND_IN)
    with gateway.GatewayProcess(command, tmp_path / "config.yaml", tmp_path / "gateway.log") as proxy:
        assert proxy.startup_s is not None
        assert httpx.get(f"{proxy.base_url}/health/liveliness", trust_env=False).status_code == 200
    assert proxy.proc.poll() is not None  # stopped by PID on exit


def test_a_gateway_that_exits_during_startup_says_so(tmp_path):
    command = _executable(tmp_path / "litellm", "import sys\nprint('bad config')\nsys.exit(2)\n")
    with pytest.raises(RuntimeError, match="the gateway exited with 2 during startup") as raised:
        gateway.GatewayProcess(command, tmp_path / "config.yaml", tmp_path / "gateway.log").start()
    assert "bad config" in str(raised.value)
