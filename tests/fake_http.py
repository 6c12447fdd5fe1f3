"""An aiohttp app served on a free 127.0.0.1 port from a thread of its own:
the fake engines the bench tests drive, without a vLLM server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def serving_app(app: Any) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    from aiohttp import web

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
