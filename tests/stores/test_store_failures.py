"""A bad store configuration fails fast; the same failures at run time fall back.

Startup: :func:`~vllm_output_rate.stores.redis_store.check_store_at_startup`
against REAL redis-server processes (plain with a password, TLS, a one-node
cluster) started here on 127.0.0.1 and stopped by PID: each configuration the
engines could never use raises one line naming ``--output-rate-store``, with
the password left out; a store that is only down warns and lets startup go on.

Run time: a lease limiter whose server starts refusing its password, stops
answering or dies goes to the configured fallback (the mode the store-mode
metric exports) and comes back when the server answers again.  Every wait is
a hang guard (:data:`LIVENESS_S`), never a figure under test.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from redis_harness import RedisServer, free_port, redis_binary
from vllm_output_rate.policy.limiter import NS_PER_S
from vllm_output_rate.stores import redis_store
from vllm_output_rate.stores.backend import CLOSED, LOCAL, SHARED, LeaseConfig
from vllm_output_rate.stores.config import PASSWORD_ENV, STORE_FLAG
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.stores.redis_store import (
    RedisLeaseBackend,
    StoreConfigError,
    check_store_at_startup,
)

pytest.importorskip("redis")

S = NS_PER_S
PASSWORD = "s3cret-pw"
WRONG = "wr0ng-pw"
#: How long a test waits for something that must happen: a guard against hanging.
LIVENESS_S = 10


class ExtraServer:
    """A redis-server child with extra arguments (TLS, cluster mode), stopped by PID."""

    def __init__(self, args: list[str], port: int, probe) -> None:
        binary = redis_binary()
        if binary is None:
            pytest.skip("no redis-server binary (make setup installs it)")
        self.port = port
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--loglevel", "warning", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + LIVENESS_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"redis-server refused {args[:2]} (exit {self.proc.returncode})")
            try:
                if probe(port):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        pytest.fail("redis-server did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _accepts(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True


@pytest.fixture(scope="module")
def plain():
    srv = RedisServer(password=PASSWORD).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A redis-server that speaks only TLS (a self-signed certificate)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a certificate")
    root = tmp_path_factory.mktemp("redis-tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    port = free_port()
    srv = ExtraServer(
        ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"],
        port, _accepts,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory):
    """A one-node Redis Cluster holding every slot."""
    import redis

    version = subprocess.run([redis_binary() or "redis-server", "--version"],
                             capture_output=True, text=True).stdout
    major = re.search(r"v=(\d+)\.", version)
    if major is None or int(major.group(1)) < 7:
        pytest.skip(f"needs redis-server >= 7.0 (ADDSLOTSRANGE), found {version.strip()!r}")
    root = tmp_path_factory.mktemp("redis-cluster-node")
    port = free_port()
    srv = ExtraServer(
        ["--port", str(port), "--cluster-enabled", "yes",
         "--cluster-config-file", str(root / "nodes.conf"), "--cluster-port", str(free_port())],
        port, _accepts,
    )
    client = redis.Redis(port=port)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    client.close()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _no_password_in_env(monkeypatch):
    # Set first so that the variable is restored (removed) after the test:
    # parsing the store flag moves its password there.
    monkeypatch.setenv(PASSWORD_ENV, "")
    monkeypatch.delenv(PASSWORD_ENV)


def refusal(url: str) -> str:
    """The one-line error of the startup check for ``url``."""
    with pytest.raises(StoreConfigError) as caught:
        check_store_at_startup(url)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{STORE_FLAG} "), message
    for secret in (PASSWORD, WRONG):
        assert secret not in message
    return message


# -- startup -----------------------------------------------------------------------


def test_a_good_store_passes_the_check(plain, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        check_store_at_startup(f"redis://:{PASSWORD}@127.0.0.1:{plain.port}/0")
        monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
        check_store_at_startup(f"redis://127.0.0.1:{plain.port}/0")
    assert not caplog.records


def test_wrong_password_is_refused(plain, monkeypatch):
    message = refusal(f"redis://:{WRONG}@127.0.0.1:{plain.port}/0")
    assert "refused the password" in message
    monkeypatch.setenv(PASSWORD_ENV, WRONG)  # the flag's password moves here
    assert "refused the password" in refusal(f"redis://127.0.0.1:{plain.port}/0")


def test_missing_password_is_refused(plain):
    message = refusal(f"redis://127.0.0.1:{plain.port}/0")
    assert "needs a password" in message and PASSWORD_ENV in message


def test_store_user_rights(plain):
    """A user allowed only what the lease rounds send passes; one that may not run scripts does not."""
    admin = plain.client()
    try:
        admin.acl_setuser("lease-only", enabled=True, passwords=["+lease-pw"], keys=["*"],
                          commands=["+ping", "+eval", "+evalsha", "+script"])
        admin.acl_setuser("no-scripts", enabled=True, passwords=["+plain-pw"], keys=["*"],
                          commands=["+ping", "+info", "+get"])
    finally:
        admin.close()
    check_store_at_startup(f"redis://lease-only:lease-pw@127.0.0.1:{plain.port}/0")
    message = refusal(f"redis://no-scripts:plain-pw@127.0.0.1:{plain.port}/0")
    assert "may not run the commands the engines need" in message and "plain-pw" not in message


def test_unknown_host_is_refused():
    message = refusal("redis://no-such-store.invalid:6379/0")
    assert "unknown host 'no-such-store.invalid'" in message


def test_unknown_cluster_seed_is_refused():
    assert "unknown host" in refusal("redis+cluster://no-such-store.invalid:7000")


def test_tls_url_against_a_plain_server_is_refused(plain):
    message = refusal(f"rediss://:{PASSWORD}@127.0.0.1:{plain.port}/0")
    assert "does not use TLS: use redis://" in message


def test_plain_url_against_a_tls_server_is_refused(tls):
    assert "expects TLS: use rediss://" in refusal(f"redis://127.0.0.1:{tls.port}/0")


def test_tls_url_with_an_untrusted_certificate_is_refused(tls):
    assert "TLS handshake failed" in refusal(f"rediss://127.0.0.1:{tls.port}/0")
    check_store_at_startup(f"rediss://127.0.0.1:{tls.port}/0?ssl_cert_reqs=none")


def test_cluster_url_against_a_standalone_server_is_refused(plain):
    message = refusal(f"redis+cluster://:{PASSWORD}@127.0.0.1:{plain.port}")
    assert "not a Redis Cluster" in message and "use redis://" in message
    assert "refused the password" in refusal(f"redis+cluster://:{WRONG}@127.0.0.1:{plain.port}")


def test_standalone_url_against_a_cluster_node_is_refused(cluster_node):
    message = refusal(f"redis://127.0.0.1:{cluster_node.port}/0")
    assert "is a Redis Cluster node: use redis+cluster://" in message
    check_store_at_startup(f"redis+cluster://127.0.0.1:{cluster_node.port}")


def test_a_store_that_is_down_only_warns(caplog):
    port = free_port()  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.stores.redis_store"):
        check_store_at_startup(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
        check_store_at_startup(f"redis+cluster://127.0.0.1:{port}")
        check_store_at_startup(f"redis://127.0.0.1:{port}/0", warn_when_silent=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("fallback" in line and STORE_FLAG in line for line in lines)
    assert not any(PASSWORD in line for line in lines)


@pytest.fixture
def released():
    """An event set when the test ends, so a stalled helper thread ends with it."""
    event = threading.Event()
    yield event
    event.set()


def test_a_name_lookup_that_never_answers_is_bounded(monkeypatch, released):
    # socket.getaddrinfo is process-wide and the prestarted servers' health
    # polls resolve through it in other threads: only this test's host stalls.
    real_lookup = socket.getaddrinfo

    def stuck(host, *args, **kwargs):
        if host == "stuck.invalid":
            released.wait(LIVENESS_S)
            raise socket.gaierror("released")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    with pytest.raises(StoreConfigError, match="name lookup of host 'stuck.invalid' did not answer"):
        check_store_at_startup("redis://stuck.invalid:6379/0", step_timeout_s=0.1)


def test_the_whole_check_is_bounded(monkeypatch, caplog, released):
    monkeypatch.setattr(redis_store, "_probe_store", lambda *a: released.wait(LIVENESS_S))
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.stores.redis_store"):
        check_store_at_startup("redis://127.0.0.1:1/0", deadline_s=0.2)
    assert any("no answer within 0.2 s" in r.getMessage() for r in caplog.records)


def test_an_unexpected_failure_of_the_check_does_not_stop_startup(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("surprise")

    monkeypatch.setattr(redis_store, "_probe_store", broken)
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.stores.redis_store"):
        check_store_at_startup("redis://127.0.0.1:1/0")
    assert any("could not be checked (RuntimeError: surprise)" in r.getMessage() for r in caplog.records)


def test_the_flag_merge_refuses_a_bad_store_in_one_line(plain):
    """The hook in the flags' merge (the process that parses them, before engines)."""
    import argparse
    from types import SimpleNamespace

    from vllm_output_rate.adapter.patches import add_output_rate_args, merge_cli_into_engine_args
    from vllm_output_rate.settings import OutputRateConfigError

    parser = argparse.ArgumentParser()
    add_output_rate_args(parser)
    args = parser.parse_args([
        "--default-user-output-tokens-per-second", "5",
        STORE_FLAG, f"redis://:{WRONG}@127.0.0.1:{plain.port}/0",
    ])
    engine_args = SimpleNamespace(additional_config=None)
    with pytest.raises(OutputRateConfigError, match=f"^{STORE_FLAG} .*refused the password"):
        merge_cli_into_engine_args(engine_args, args)
    assert engine_args.additional_config is None


# -- run time ----------------------------------------------------------------------


def _limiter(url: str, fallback: str) -> LeasedOutputRateLimiter:
    return LeasedOutputRateLimiter(
        50, {}, RedisLeaseBackend(url, prefix=f"fail-{time.monotonic_ns()}"),
        config=LeaseConfig(fallback=fallback, expected_engines=2),
    )


def _spend_until(lim: LeasedOutputRateLimiter, mode: str) -> str:
    """Keep a user asking (as a busy scheduler does) until ``mode`` or the hang guard."""
    deadline = time.monotonic() + LIVENESS_S
    while time.monotonic() < deadline and lim.health.mode != mode:
        lim.take_up_to("u", time.monotonic_ns(), 2)
        time.sleep(0.005)
    return lim.health.mode


def _shared_and_answering(lim: LeasedOutputRateLimiter) -> bool:
    """Spend until the store has answered a round trip (the hang guard bounds it)."""
    deadline = time.monotonic() + LIVENESS_S
    while time.monotonic() < deadline and lim.stats["round_trips"] < 1:
        lim.take_up_to("u", time.monotonic_ns(), 2)
        time.sleep(0.005)
    return lim.health.mode == SHARED and lim.stats["round_trips"] >= 1


@pytest.mark.parametrize("fallback", [LOCAL, CLOSED])
def test_password_changed_at_run_time_falls_back_then_recovers(fallback):
    srv = RedisServer().start()
    admin = srv.client()
    lim = _limiter(srv.url, fallback)
    try:
        assert _shared_and_answering(lim)
        # Connections already signed in keep working after a password change;
        # the engine meets it when it connects again.
        admin.config_set("requirepass", PASSWORD)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert _spend_until(lim, fallback) == fallback
        assert lim.stats["outages"] == 1
        admin.config_set("requirepass", "")
        assert _spend_until(lim, SHARED) == SHARED
    finally:
        lim.close()
        admin.close()
        srv.stop()


@pytest.mark.parametrize("fallback", [LOCAL, CLOSED])
def test_a_server_that_stops_answering_is_an_outage_not_a_hang(fallback):
    """SIGSTOP: connections stay open and nothing answers; every call must time out."""
    srv = RedisServer().start()
    lim = _limiter(srv.url, fallback)
    try:
        assert _shared_and_answering(lim)
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            assert _spend_until(lim, fallback) == fallback
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert _spend_until(lim, SHARED) == SHARED
    finally:
        lim.close()
        srv.stop()


def test_server_killed_with_the_closed_fallback_pauses_users():
    srv = RedisServer().start()
    lim = _limiter(srv.url, CLOSED)
    try:
        assert _shared_and_answering(lim)
        srv.stop()
        assert _spend_until(lim, CLOSED) == CLOSED
        # Closed: nothing more is spent beyond the leases already cleared.
        assert lim.take_up_to("u", time.monotonic_ns(), 5) == 0
    finally:
        lim.close()
        srv.stop()


def test_a_name_lookup_that_hangs_at_run_time_is_an_outage(monkeypatch):
    """redis-py bounds the connect and the replies, not the host-name lookup;
    the backend's connections bound it too, so the engine falls back."""
    srv = RedisServer().start()
    admin = srv.client()
    release = threading.Event()
    real_lookup = socket.getaddrinfo

    def lookup(host, *args, **kwargs):
        if host == "localhost" and hanging:
            release.wait(LIVENESS_S * 2)
        return real_lookup(host, *args, **kwargs)

    hanging = False
    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    lim = _limiter(f"redis://localhost:{srv.port}/0", LOCAL)
    try:
        assert _shared_and_answering(lim)
        hanging = True
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert _spend_until(lim, LOCAL) == LOCAL
        hanging = False
        release.set()
        assert _spend_until(lim, SHARED) == SHARED
    finally:
        release.set()
        lim.close()
        admin.close()
        srv.stop()
