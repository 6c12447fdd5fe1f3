"""The test and benchmark harnesses of ``vllm-output-rate`` (not in its wheel).

* :mod:`.scheduler_sim` -- vLLM's real scheduler and KV cache manager
  without a model (the scheduler-level tests, ``benchmarks/scheduler_step.py``);
* :mod:`.benchkit` -- what every script in ``benchmarks/`` shares;
* :mod:`.churn` -- preemption churn counters for benchmark servers;
* :mod:`.gateway` -- LiteLLM's proxy as a gateway limiter
  (``benchmarks/gateway_compare.py``).

Installed (editable) by ``make setup``; the plugin never imports it.
"""
