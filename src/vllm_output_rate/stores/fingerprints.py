"""Engines sharing a store should enforce the same limits: publish and compare.

Every engine publishes a fingerprint of its limits (rates, burst) in the
store every few seconds and logs a warning, once per engine and
fingerprint, when another engine of the deployment (same key prefix)
publishes a different one.
"""

from __future__ import annotations

import hashlib
import json
import logging

from vllm_output_rate.policy.rates import RateTable
from vllm_output_rate.stores.backend import LeaseBackend

logger = logging.getLogger("vllm_output_rate.stores.lease")


def limits_fingerprint(rates: RateTable) -> str:
    """A short hash of the limits; equal limits give equal fingerprints."""
    default, overrides = rates.configured()
    body = json.dumps(
        {
            "default": str(default),
            "users": {u: str(r) for u, r in sorted(overrides.items())},
            "burst_ns": rates.burst_ns,
        },
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class LimitsFingerprints:
    """This engine's side of the limits check: when to publish, whom it warned about."""

    def __init__(self, backend: LeaseBackend, engine_id: str, every_ns: int, now_ns: int) -> None:
        self._backend = backend
        self._engine_id = engine_id
        self._every_ns = every_ns
        self.next_ns = now_ns
        self._warned: set[tuple[str, str]] = set()

    def check(self, now_ns: int, rates: RateTable) -> list[str]:
        """Publish the fingerprint of ``rates``; warn about engines that differ.

        Returns the ids of live engines whose fingerprint differs.
        """
        self.next_ns = now_ns + self._every_ns
        mine = limits_fingerprint(rates)
        try:
            everyone = self._backend.publish_fingerprint(self._engine_id, mine)
        except Exception:
            return []  # the lease rounds notice outages
        differ = sorted(e for e, fp in everyone.items() if e != self._engine_id and fp != mine)
        for engine in differ:
            key = (engine, everyone[engine])
            if key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "output-rate limits differ between engines sharing store prefix: "
                    "engine %s has limits fingerprint %s, this engine (%s) has %s",
                    engine,
                    everyone[engine],
                    self._engine_id,
                    mine,
                )
        return differ
