"""A group's quota shared through a REAL redis-server (issue 25).

Two engines (each its own users' limiter and its own groups' limiter, with
their own connections and lease threads, as separate engines would have)
serve two users of one group, one user each.  Every token either engine
gives is a take on the group's quota in the store, under keys of its own
(``{prefix}:group:user:{<group>}``), so the two users together stay within
the store's bound for the group's rate over two engines.  Spend times are
read on this process's monotonic clock; only the bound is judged, with a
generous timeout for the tokens to come at all.
"""

from __future__ import annotations

import threading
import time

import pytest

from redis_harness import RedisServer
from test_store_redis import LIVENESS_S, bound, max_in_window
from vllm_output_rate.factory import (
    GROUP_PREFIX_SUFFIX,
    make_borrowing,
    make_group_quotas,
    make_limiter,
)
from vllm_output_rate.policy.limiter import NS_PER_S
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.stores.redis_store import user_key

pytest.importorskip("redis")

S = NS_PER_S
GROUP_RATE = 30


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop()


def test_two_engines_share_one_groups_quota(server):
    prefix = f"groups-{time.monotonic_ns()}"
    settings = OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": 1000,
        "user_output_tokens_per_second": {"a": {"rate": 100, "group": "g"},
                                          "b": {"rate": 100, "group": "g"}},
        "groups": {"g": GROUP_RATE},
        "store": {"url": server.url, "prefix": prefix, "fallback": "closed"},
    }})
    engines = []
    for _ in range(2):
        rate = make_limiter(settings)
        groups = make_group_quotas(settings)
        _, limiter = make_borrowing(settings, rate, None, groups)
        engines.append((rate, groups, limiter))
    try:
        groups = engines[0][1]
        assert isinstance(groups.rate, LeasedOutputRateLimiter)
        assert groups.rate.backend.prefix == prefix + GROUP_PREFIX_SUFFIX
        spent: dict[str, list[int]] = {"a": [], "b": []}
        stop_at = time.monotonic_ns() + 3 * S

        def serve(user: str, limiter) -> None:
            # The engine's scheduler: up to 8 streams of its user every 4 ms.
            while time.monotonic_ns() < stop_at:
                now = time.monotonic_ns()
                spent[user] += [now] * limiter.take_up_to(user, now, 8)
                time.sleep(0.004)

        threads = [threading.Thread(target=serve, args=(user, engine[2]))
                   for user, engine in zip("ab", engines)]
        for t in threads:
            t.start()
        # The keys while the engines serve: a key goes when nothing is left to
        # remember, at most 10 s after its last round, and on a loaded machine
        # a check after the threads end came later than that (a flake seen once).
        client = server.client()
        keys = {"group": user_key(prefix + GROUP_PREFIX_SUFFIX, "g"),
                "a": user_key(prefix, "a"), "b": user_key(prefix, "b")}
        seen: set[str] = set()
        while time.monotonic_ns() < stop_at and len(seen) < len(keys):
            seen |= {name for name, key in keys.items() if client.exists(key)}
            assert not client.exists(user_key(prefix, "g"))  # apart from every user's keys
            time.sleep(0.02)
        for t in threads:
            t.join(timeout=LIVENESS_S + 3)
        assert seen == set(keys), seen
        assert spent["a"] and spent["b"], {u: len(t) for u, t in spent.items()}
        both = spent["a"] + spent["b"]
        print(f"\ngroup of {GROUP_RATE} tok/s on two engines: a {len(spent['a'])}, "
              f"b {len(spent['b'])} tokens in 3 s")
        for window_s in (0.1, 0.5, 1, 2, 3):
            window = int(window_s * S)
            assert max_in_window(both, window) <= bound(window, GROUP_RATE, 2), window_s
        assert not client.exists(user_key(prefix, "g"))
    finally:
        for rate, groups, _ in engines:
            rate.close()
            groups.close()
