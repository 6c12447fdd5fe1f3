"""Shared quota stores: one user's output-token quota across several engines.

The in-memory limiter (:class:`vllm_output_rate.policy.limiter.OutputRateLimiter`
over a plain dict) needs nothing from here.  With ``--output-rate-store
redis://...`` every engine of a deployment spends *leases* of one shared GCRA
quota kept in Redis:

* :mod:`.backend` -- what both sides share: the round trip's value types
  (``LeaseAsk``, ``LeaseGrant``), the ``LeaseBackend`` protocol, the lease
  settings (``LeaseConfig``) and the store modes.
* :mod:`.lease` -- the engine side: :class:`~.lease.LeasedOutputRateLimiter`
  (the limiter interface the scheduler calls, spending only local leases, so a
  step never waits on the network) and the guarantee across engines; it
  composes :mod:`.lease_book` (leases held), :mod:`.rounds` (the background
  lease thread), :mod:`.health` (the fallback when the store is unreachable)
  and :mod:`.fingerprints` (the limits check between engines).
* :mod:`.redis_store` -- the server side: one Lua script that runs GCRA on
  Redis's clock for a batch of users per round trip (one call per node on a
  Redis Cluster, pipelined), plus key naming, connection handling and the
  limits-fingerprint check.
"""
