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

from vllm_output_rate.tools import serverproc
from vllm_output_rate_harness import gateway

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


# The gateway (vllm_output_rate_harness.gateway) starts through the same wait, on its own health path.
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


# -- a server that dies: its load and its tests stop at once, with its log tail ---------------


def _kill_and_wait(server) -> None:
    server.proc.kill()
    server.proc.wait(timeout=30)


def test_a_dead_server_is_reported_with_its_first_cause_and_log_tail(stand_in, tmp_path):
    with serverproc.running_server([], tmp_path, command=stand_in) as server:
        server.check_alive()  # running: nothing to say
        with open(server.log_path, "a") as log:
            log.write("ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -4)\nlast words\n")
        _kill_and_wait(server)
        with pytest.raises(serverproc.ServerDied) as died:
            server.check_alive()
    first_line, _, rest = str(died.value).partition("\n")
    assert f"pid {server.pid}" in first_line and "exited with code -9" in first_line
    assert "died unexpectedly (exit code: -4)" in first_line  # the cause, where a test summary shows it
    assert rest.splitlines()[-1] == "last words"


def test_a_load_loop_backs_off_while_its_server_refuses_and_stops_once_it_has_exited(stand_in, tmp_path):
    import asyncio

    backoff = serverproc.ConnectionBackoff(first_s=0.01, cap_s=0.04)
    with serverproc.running_server([], tmp_path, command=stand_in) as server:
        pauses = []
        for _ in range(4):  # alive but failing: pauses double up to the cap
            pauses.append(backoff.pause_s)
            asyncio.run(backoff.failed(server))
        assert pauses == [0.01, 0.02, 0.04, 0.04]
        backoff.succeeded()
        assert backoff.pause_s == 0.01
        asyncio.run(backoff.failed(None))  # an engine down on purpose: only a pause
        _kill_and_wait(server)
        with pytest.raises(serverproc.ServerDied):
            asyncio.run(backoff.failed(server))
        with pytest.raises(serverproc.ServerDied):
            backoff.failed_sync(server)


def test_a_scenario_is_cancelled_when_a_server_it_uses_dies(stand_in, tmp_path):
    import asyncio

    cancelled = []

    async def endless():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with serverproc.running_server([], tmp_path, command=stand_in) as server:
        async def scenario():
            guarded = asyncio.ensure_future(serverproc.while_alive(endless(), lambda: [server], period_s=0.05))
            await asyncio.sleep(0.2)
            assert not guarded.done()  # alive: the scenario goes on
            server.proc.kill()
            return await guarded

        with pytest.raises(serverproc.ServerDied):
            asyncio.run(scenario())
    assert cancelled == [True]


def test_a_scenario_over_a_live_server_returns_its_result(stand_in, tmp_path):
    import asyncio

    async def short():
        await asyncio.sleep(0.1)
        return 42

    with serverproc.running_server([], tmp_path, command=stand_in) as server:
        assert asyncio.run(serverproc.while_alive(short(), lambda: [server], period_s=0.02)) == 42
