"""What every measurement of a running server shares: one streaming client,
one Prometheus reader, one window convention.

Used by ``vllm-output-rate bench``/``demo``, the end-to-end tests and the
real-server benchmarks, so that tokens are counted, times are taken and
``/metrics`` is read the same way everywhere.

Streaming client (:func:`stream_completion`)
    Built on the ``openai`` client.  Tokens are counted exactly from the
    ``token_ids`` vLLM puts on every streamed choice when the request asks for
    ``return_token_ids`` (one chunk may carry several tokens).  Times are the
    client's own ``time.monotonic()`` minus a caller-given origin ``t0``:
    ``start`` just before the request is sent, one receive time per token,
    ``end`` when the stream ended.  They do not depend on the server's clock.
    Server-side per-request timing (``--enable-per-request-metrics``) is kept
    when the server sends it: ``server_generation_s``, the server's own
    first->last output token interval, and ``server_first_token_s``, queue
    time plus time to first token as the engine stamped them.

Window convention (:func:`max_in_window`)
    A window of W seconds is the *closed* interval ``[t, t + W]``: two events
    exactly W apart share a window.  This is the conservative choice for an
    upper bound ("at most X tokens in any window of W s").

Prometheus (:func:`parse_metrics`, :func:`metric_sum`)
    ``/metrics`` text is parsed with ``prometheus_client.parser``; samples are
    keyed by their exposed name (counters keep their ``_total`` suffix).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from vllm_output_rate.settings import USER_ARG

# Request outcomes (RequestRecord.status).
FINISHED = "finished"  # every choice reported a finish_reason
HTTP_ERROR = "http_error"  # non-200 response
ERROR = "error"  # exception, error event, or stream cut short
CANCELLED = "cancelled"  # stopped by the client (cancel_after, task cancelled)
RUNNING = "running"  # only while the request is in flight
ERROR_STATUSES = (HTTP_ERROR, ERROR)

#: Keys of a request body the openai client takes as named arguments; every
#: other key (ignore_eos, return_token_ids, vllm_xargs, ...) goes to extra_body.
_NAMED = {
    "completions": ("model", "prompt", "stream", "stream_options"),
    "chat": ("model", "messages", "stream", "stream_options"),
}


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds since ``t0``)."""

    user: str
    stream: int = 0  # which of the user's stream slots issued it
    start: float = 0.0  # just before the request was sent
    token_times: list[float] = field(default_factory=list)  # one per token, all choices
    end: float | None = None  # when the stream ended (or was cut)
    completion_tokens: int | None = None  # server's usage, from the last usage chunk
    prompt_tokens: int | None = None
    status: str = RUNNING
    http_status: int | None = None
    error: str | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)  # per choice index
    server_generation_s: float | None = None  # server's first->last output token interval
    server_first_token_s: float | None = None  # server's queue time + time to first token
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # only with keep_ids
    url: str | None = None  # the engine that served it (bench over several engines)

    @property
    def n_tokens(self) -> int:
        return len(self.token_times)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["token_ids"]:
            del data["token_ids"]
        data["finish_reasons"] = {str(k): v for k, v in self.finish_reasons.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestRecord":
        return cls(
            user=data["user"],
            stream=int(data.get("stream", 0)),
            start=float(data["start"]),
            token_times=[float(t) for t in data.get("token_times", [])],
            end=data.get("end"),
            completion_tokens=data.get("completion_tokens"),
            prompt_tokens=data.get("prompt_tokens"),
            status=data.get("status", FINISHED),
            http_status=data.get("http_status"),
            error=data.get("error"),
            finish_reasons={int(k): v for k, v in (data.get("finish_reasons") or {}).items()},
            server_generation_s=data.get("server_generation_s"),
            server_first_token_s=data.get("server_first_token_s"),
            token_ids={int(k): list(v) for k, v in (data.get("token_ids") or {}).items()},
            url=data.get("url"),
        )


def usage_matches(record: RequestRecord) -> bool:
    """Does the server's completion_tokens equal the tokens received?"""
    return record.completion_tokens == record.n_tokens


# --------------------------------------------------------------------------
# Streaming client
# --------------------------------------------------------------------------

_wrapped: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def openai_client(base_url: str, max_connections: int = 64, timeout: float | None = None):
    """An ``AsyncOpenAI`` for a vLLM server at ``base_url`` (no ``/v1``).

    No retries (a retried request would be counted twice), no proxies from the
    environment (timing must be measured against the server directly), and no
    read timeout by default: a rate-limited stream may pause.
    """
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=timeout, write=10.0, pool=None),
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections),
        trust_env=False,
    )
    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused",
                       max_retries=0, http_client=http)


def _as_openai(client: Any):
    """Accept an ``AsyncOpenAI`` or an ``httpx.AsyncClient`` with a base_url."""
    from openai import AsyncOpenAI

    if isinstance(client, AsyncOpenAI):
        return client
    return openai_for(client, str(client.base_url))


def openai_for(http_client: Any, base_url: str):
    """An ``AsyncOpenAI`` over an existing ``httpx.AsyncClient`` (cached per client)."""
    from openai import AsyncOpenAI

    key = (base_url.rstrip("/"),)
    per_client = _wrapped.setdefault(http_client, {})
    if key not in per_client:
        per_client[key] = AsyncOpenAI(base_url=key[0] + "/v1", api_key="unused", max_retries=0,
                                      http_client=http_client)
    return per_client[key]


def _extra(obj: Any, name: str) -> Any:
    """A field vLLM adds to an OpenAI object (kept by the openai models as extra)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def _apply_chunk(record: RequestRecord, chunk: Any, received: float, keep_ids: bool,
                 count_chars: bool = False) -> None:
    for choice in chunk.choices or []:
        ids = _extra(choice, "token_ids")
        if ids is None:
            text = getattr(choice, "text", None) or getattr(getattr(choice, "delta", None), "content", None)
            if text and not count_chars:
                raise ValueError("chunk without token_ids (does the server support return_token_ids?)")
            # count_chars: the caller made every token one character (see stream_completion).
            ids = [None] * len(text or "")
        index = getattr(choice, "index", 0) or 0
        record.token_times.extend([received] * len(ids))
        if keep_ids:
            record.token_ids.setdefault(index, []).extend(ids)
        if choice.finish_reason:
            record.finish_reasons[index] = choice.finish_reason
    usage = getattr(chunk, "usage", None)
    if usage:
        record.completion_tokens = usage.completion_tokens
        record.prompt_tokens = usage.prompt_tokens
    metrics = _extra(chunk, "metrics")
    if isinstance(metrics, Mapping):
        if metrics.get("generation_time_ms") is not None:
            record.server_generation_s = metrics["generation_time_ms"] / 1000.0
        if metrics.get("time_to_first_token_ms") is not None:
            record.server_first_token_s = (
                (metrics.get("queue_time_ms") or 0.0) + metrics["time_to_first_token_ms"]) / 1000.0


async def stream_completion(
    client: Any,
    body: Mapping[str, Any],
    record: RequestRecord,
    t0: float,
    *,
    endpoint: str = "completions",
    cancel_after: int | None = None,
    keep_ids: bool = False,
    headers: Mapping[str, str] | None = None,
    count_chars: bool = False,
) -> RequestRecord:
    """Stream one request and fill ``record`` as chunks arrive.

    ``body`` is the JSON body as vLLM takes it (``prompt`` or ``messages``,
    ``max_tokens``, ``return_token_ids``, ``vllm_xargs``, ...); usage is
    asked for unless ``stream_options`` says otherwise.  With
    ``cancel_after`` the stream is closed once that many tokens arrived
    (status CANCELLED).  Errors end up in the record, never raised, except
    ``asyncio.CancelledError`` (the record is then CANCELLED).  ``headers``
    are sent with the request (a gateway's per-user key).  ``count_chars``
    counts one token per character of a chunk that carries no token ids (a
    proxy that drops vLLM's fields); it is exact only when the request makes
    every token one character (``allowed_token_ids``), which the usage check
    then confirms.
    """
    import openai

    oa = _as_openai(client)
    named = {k: v for k, v in body.items() if k in _NAMED[endpoint]}
    extra = {k: v for k, v in body.items() if k not in _NAMED[endpoint]}
    named["stream"] = True
    # The final usage chunk carries usage and the per-request metrics.
    named.setdefault("stream_options", {"include_usage": True})
    create = oa.chat.completions.create if endpoint == "chat" else oa.completions.create
    record.start = time.monotonic() - t0
    try:
        stream = await create(**named, extra_body=extra, extra_headers=dict(headers or {}) or None)
        record.http_status = 200
        try:
            async for chunk in stream:
                received = time.monotonic() - t0
                _apply_chunk(record, chunk, received, keep_ids, count_chars)
                if cancel_after is not None and record.n_tokens >= cancel_after:
                    record.status = CANCELLED
                    break
        finally:
            await stream.close()
        if record.status != CANCELLED:
            if record.finish_reasons and None not in record.finish_reasons.values():
                record.status = FINISHED
            else:
                record.status = ERROR
                record.error = "stream ended without a finish_reason"
    except asyncio.CancelledError:
        record.status = CANCELLED
        raise
    except openai.APIStatusError as exc:
        record.status = HTTP_ERROR
        record.http_status = exc.status_code
        record.error = " ".join(str(exc.message).split())[:300]
    except (openai.APIError, ValueError) as exc:
        record.status = ERROR
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.end = time.monotonic() - t0
    return record


DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a long story:"


def stream_body(model: str, user: str | None, max_tokens: int, prompt: Any = DEFAULT_PROMPT) -> dict[str, Any]:
    """The streaming ``/v1/completions`` body the bench and the benchmarks send.

    ``ignore_eos``: every request runs to ``max_tokens``, so the load does not
    depend on the text; ``return_token_ids``: exact token counts per chunk.
    ``user`` None sends no identity (the anonymous user).
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if user is not None:
        body["vllm_xargs"] = {USER_ARG: user}
    return body


async def run_request(client: Any, body: Mapping[str, Any], record: RequestRecord, t0: float) -> None:
    """Stream one ``/v1/completions`` request into ``record`` (benchmark scripts)."""
    await stream_completion(client, body, record, t0)


# --------------------------------------------------------------------------
# Client stalls
# --------------------------------------------------------------------------

LOOP_LAG_INTERVAL_S = 0.01


async def watch_loop_lag(samples: list[float], interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Record how late the client's event loop wakes up, until cancelled.

    Receive times are taken when the loop gets to a chunk; a stalled client
    bunches tokens the server spread out.
    """
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        samples.append(max(0.0, time.monotonic() - before - interval_s))


# --------------------------------------------------------------------------
# Windows and percentiles
# --------------------------------------------------------------------------


def max_in_window(times: Iterable[float], window_s: float) -> int:
    """Most events in any closed window ``[t, t + window_s]``."""
    ordered = sorted(times)
    best = 0
    left = 0
    for right, t in enumerate(ordered):
        while t - ordered[left] > window_s:
            left += 1
        best = max(best, right - left + 1)
    return best


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """``/metrics`` text -> {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_sum(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None if absent."""
    values = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    return sum(values) if values else None


def fetch_metrics(base_url: str, timeout: float = 10.0) -> Samples:
    import httpx

    return parse_metrics(httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout,
                                   trust_env=False).text)


async def fetch_metrics_async(client: Any, timeout: float = 10.0) -> Samples:
    """``client`` is an ``httpx.AsyncClient`` with the server as base_url."""
    return parse_metrics((await client.get("/metrics", timeout=timeout)).text)


#: The plugin's per-user counter of charged output tokens (label ``user``).
CHARGED_TOKENS = "vllm:output_rate_output_tokens_charged_total"


def per_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Samples called ``name`` summed by the value of ``label`` (other labels summed over)."""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


RUNNING_GAUGE = "vllm:num_requests_running"
WAITING_GAUGE = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"


def gauges(samples: Samples) -> dict[str, float]:
    """Requests running and waiting (0 when absent)."""
    return {name: metric_sum(samples, name) or 0.0 for name in (RUNNING_GAUGE, WAITING_GAUGE)}
