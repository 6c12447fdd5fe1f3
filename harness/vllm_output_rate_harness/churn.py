"""Preemption churn counters for benchmark servers.

vLLM 0.32 exports how often it preempts (``vllm:num_preemptions_total``) but
not what the preemptions cost: a preempted request loses its KV and, when it
is admitted again, its prompt plus every token generated so far is prefilled
again, except what the prefix cache still holds.  vLLM does measure that: its
prefix-cache statistics keep re-admissions of preempted requests apart
(``PrefixCacheStats.preempted_requests / preempted_queries /
preempted_hits``), but only the figures of new requests reach ``/metrics``.

This module exports the re-admission figures as three counters::

    vllm_output_rate:readmitted_requests_total       re-admissions of preempted requests
    vllm_output_rate:readmitted_tokens_total         their tokens (prompt + output so far)
    vllm_output_rate:readmitted_cached_tokens_total  of those, found in the prefix cache

so recomputed tokens = readmitted_tokens - readmitted_cached_tokens.  The
figures come from the prefix-cache lookup, so they exist only with prefix
caching on (vLLM's default).

It is a measurement aid for the benchmarks, not part of the plugin (nor of
its wheel): ``python -m vllm_output_rate_harness.churn [vllm serve args]``
(:data:`SERVE_WITH_CHURN`) is
``vllm-output-rate serve`` with one extra vLLM stat logger (added to the
frontend's stat loggers before the engine client is built; one API server).
"""

from __future__ import annotations

import sys
from typing import Any

#: ``command`` for ``serverproc.running_server``: ``vllm-output-rate serve``
#: plus the churn counters.
SERVE_WITH_CHURN = [sys.executable, "-m", "vllm_output_rate_harness.churn"]

READMITTED_REQUESTS = "vllm_output_rate:readmitted_requests"
READMITTED_TOKENS = "vllm_output_rate:readmitted_tokens"
READMITTED_CACHED = "vllm_output_rate:readmitted_cached_tokens"

_counters: dict[str, Any] = {}


def _counter(name: str, documentation: str):
    if name not in _counters:
        from prometheus_client import Counter

        _counters[name] = Counter(name, documentation, labelnames=["engine"])
    return _counters[name]


def stat_logger_class():
    """A vLLM ``StatLoggerBase`` subclass exporting the re-admission counters."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ChurnStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            label = str(engine_index)
            self.requests = _counter(READMITTED_REQUESTS, "Re-admissions of preempted requests.").labels(label)
            self.tokens = _counter(
                READMITTED_TOKENS, "Tokens (prompt + output so far) of re-admitted preempted requests."
            ).labels(label)
            self.cached = _counter(
                READMITTED_CACHED, "Tokens of re-admitted preempted requests found in the prefix cache."
            ).labels(label)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is None:
                return
            if stats.preempted_requests:
                self.requests.inc(stats.preempted_requests)
                self.tokens.inc(stats.preempted_queries)
                self.cached.inc(stats.preempted_hits)

        def log_engine_initialized(self):
            pass

    return ChurnStatLogger


def install() -> None:
    """Add the churn stat logger to the ones vLLM's frontend loads from plugins."""
    import vllm.v1.metrics.loggers as loggers

    original = loggers.load_stat_logger_plugin_factories
    extra = stat_logger_class()

    def with_churn():
        return [*original(), extra]

    loggers.load_stat_logger_plugin_factories = with_churn
    async_llm = sys.modules.get("vllm.v1.engine.async_llm")
    if async_llm is not None:
        async_llm.load_stat_logger_plugin_factories = with_churn


def recompute_figures(before: dict, after: dict) -> dict[str, float | None]:
    """Churn between two ``measure.parse_metrics`` readings of one server.

    ``preemptions`` from vLLM's own counter; ``recomputed_tokens`` =
    re-admitted tokens - those found in the prefix cache (None when the
    server does not export the churn counters).
    """
    from vllm_output_rate.tools.measure import PREEMPTIONS, metric_sum

    def delta(name: str) -> float | None:
        a, b = metric_sum(before, name), metric_sum(after, name)
        return None if b is None else b - (a or 0.0)

    tokens, cached = delta(READMITTED_TOKENS + "_total"), delta(READMITTED_CACHED + "_total")
    return {
        "preemptions": delta(PREEMPTIONS),
        "readmissions": delta(READMITTED_REQUESTS + "_total"),
        "readmitted_tokens": tokens,
        "readmitted_cached_tokens": cached,
        "recomputed_tokens": None if tokens is None or cached is None else tokens - cached,
        "generation_tokens": delta("vllm:generation_tokens_total"),
    }


def churn_costs(churn: dict, finished_requests: int, output_tokens: float | None = None) -> dict:
    """``churn`` (:func:`recompute_figures`) per finished request and per output token.

    ``output_tokens`` stands in when the server did not count its generated
    tokens (``generation_tokens`` None).
    """
    out = dict(churn)
    output = churn.get("generation_tokens") or output_tokens
    out["finished_requests"] = finished_requests
    out["output_tokens"] = output
    out["preemptions_per_finished_request"] = (
        round(churn["preemptions"] / finished_requests, 3)
        if finished_requests and churn.get("preemptions") is not None else None)
    out["recomputed_tokens_per_output_token"] = (
        round(churn["recomputed_tokens"] / output, 3)
        if output and churn.get("recomputed_tokens") is not None else None)
    return out


def churn_line(c: dict) -> str:
    """One line of a benchmark's report for :func:`churn_costs`."""
    line = (f"churn: {c['preemptions'] or 0:.0f} preemptions for {c['finished_requests']} finished "
            f"requests = {c['preemptions_per_finished_request']} per finished request")
    if c.get("recomputed_tokens") is None:
        return line + "; recomputed tokens unknown (server without the churn counters)"
    return line + (
        f"; {c['readmissions']:.0f} re-admissions recomputed {c['recomputed_tokens']:.0f} tokens "
        f"({c['readmitted_cached_tokens']:.0f} of {c['readmitted_tokens']:.0f} re-admitted from the "
        f"prefix cache) = {c['recomputed_tokens_per_output_token']} per output token "
        f"({c['output_tokens'] or 0:.0f} output tokens)")


def main(argv: list[str] | None = None) -> None:
    from vllm_output_rate.tools.cli import cmd_serve

    install()
    cmd_serve(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
