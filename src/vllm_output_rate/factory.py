"""Build the limiter that the settings ask for.

The one place that knows every kind of limiter: it sits above the policy and
store layers so that neither has to import the other to choose.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.policy.borrow import Borrowing, CeiledLimiter
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


#: Suffix of the ceiling quota's key prefix in a shared store: the ceiling of
#: a user lives under ``{prefix}:ceil:user:{<user>}``, apart from its rate.
CEILING_PREFIX_SUFFIX = ":ceil"


def make_ceiling_limiter(settings: OutputRateSettings, **kwargs: Any) -> Limiter:
    """The quota at each user's ``ceil`` (see :mod:`..policy.borrow`): in
    memory without a store; with one, shared through it like the rates, under
    keys of its own."""
    default, ceilings = settings.share_table().ceilings()
    store = settings.store
    if store is None:
        return OutputRateLimiter(default, ceilings)
    backend = RedisLeaseBackend(store.url, prefix=store.prefix + CEILING_PREFIX_SUFFIX)
    config = LeaseConfig(fallback=store.fallback, expected_engines=store.expected_engines)
    return LeasedOutputRateLimiter(default, ceilings, backend, config=config, **kwargs)


def make_borrowing(
    settings: OutputRateSettings, rate_limiter: Limiter, borrowing: Borrowing | None = None
) -> tuple[Borrowing | None, Limiter]:
    """Borrowing for ``settings`` and the limiter guaranteed tokens are paid
    from: (None, ``rate_limiter``) when nobody borrows, so hard caps run
    exactly as without the feature.  An existing ``borrowing`` (a reload)
    keeps its ceiling state and counters, with the new ceilings."""
    table = settings.share_table()
    if not table.any_borrower():
        if borrowing is not None:
            borrowing.ceiling.close()
        return None, rate_limiter
    if borrowing is None:
        borrowing = Borrowing(table, make_ceiling_limiter(settings))
    else:
        borrowing.update(table)
        borrowing.ceiling.update_rates(*table.ceilings())
    return borrowing, CeiledLimiter(rate_limiter, borrowing.ceiling, table)
