"""The policy layer: what is decided, over plain numbers.

GCRA and the :class:`~.limiter.Limiter` protocol, the per-step gate (lanes,
ledger, plan, victims), the eviction rule and the per-user monitor.  Plain
Python: nothing here imports vLLM, a store or any other layer of the package.
"""
