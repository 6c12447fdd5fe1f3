"""Start and stop a real ``redis-server`` (or ``valkey-server``) process.

Used by the cluster demo and, through ``tests/redis_harness.py``, by the
tests.  The server listens on 127.0.0.1 only (a free port unless one is
given), runs in the foreground as a child of the caller without persistence
(``--save ''``, no append-only file), and is stopped by its PID.  ``make
setup`` installs Debian's ``redis-server`` package when no binary is found.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from vllm_output_rate.tools.serverproc import free_port


def redis_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisProcess:
    """One redis-server child process; ``stop()`` then ``start()`` keeps the port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("no redis-server or valkey-server binary (make setup installs one)")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 10.0) -> "RedisProcess":
        """Start the server and wait until it answers PING (or asks for a password)."""
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        """Kill the server by its PID (SIGKILL: an abrupt outage) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def __enter__(self) -> "RedisProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
