"""Start and stop a real ``redis-server`` process for tests (127.0.0.1, random port).

Thin test-side names over :mod:`vllm_output_rate.tools.redisproc` (shared
with ``make demo-cluster``): the server runs in the foreground as a child of
the test process, without persistence, and is stopped by its PID.  A test
is skipped when no binary is installed (``make setup`` installs Debian's
``redis-server`` package).
"""

from __future__ import annotations

import pytest

from vllm_output_rate.tools.redisproc import RedisProcess, redis_binary  # noqa: F401
from vllm_output_rate.tools.serverproc import free_port  # noqa: F401


class RedisServer(RedisProcess):
    """One redis-server child process; ``stop()`` / ``start()`` keep the port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        if redis_binary() is None:
            pytest.skip("no redis-server binary (make setup installs it)")
        super().__init__(port, password)
