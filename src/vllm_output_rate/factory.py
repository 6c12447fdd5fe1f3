"""Build the limiter that the settings ask for.

The one place that knows every kind of limiter: it sits above the policy and
store layers so that neither has to import the other to choose.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.policy.limiter import Limiter, OutputRateLimiter
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.stores.backend import LeaseConfig
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.stores.redis_store import RedisLeaseBackend


def make_limiter(settings: OutputRateSettings, **kwargs: Any) -> Limiter:
    """The exact in-memory limiter without a store; with one, a leased limiter
    spending the quota shared through it (``kwargs`` go to its constructor)."""
    store = settings.store
    if store is None:
        return OutputRateLimiter(settings.default_rate, settings.user_rates)
    backend = RedisLeaseBackend(store.url, prefix=store.prefix)
    config = LeaseConfig(fallback=store.fallback, expected_engines=store.expected_engines)
    return LeasedOutputRateLimiter(
        settings.default_rate, settings.user_rates, backend, config=config, **kwargs
    )
