"""Per-user series on vLLM's own ``/metrics``, through vLLM's scheduler-stats path.

The engine core attaches a per-user report
(:mod:`vllm_output_rate.policy.monitor`) to the ``SchedulerStats`` it sends
to the API server after a step (see :mod:`.operate`).  Two patches of the
registry (:data:`.patches.PATCHES`) carry it to Prometheus:

``metrics.scheduler_stats`` (:func:`install_stats_field`)
    ``SchedulerStats`` gains one optional field, ``output_rate`` (a plain
    dict, ``None`` by default), so vLLM's msgpack encoder/decoder carry it
    between processes.  Installed by the plugin entry point in every process
    before the first stats message is encoded or decoded.
``metrics.prometheus`` (:func:`install_prometheus_export`)
    ``PrometheusStatLogger.record`` also feeds the report into the series
    below (in the same registry, so ``/metrics`` shows them, also with
    ``--api-server-count`` > 1, where vLLM uses Prometheus' multiprocess mode).

Series (labels ``model_name``, ``user``):

* ``vllm:output_rate_output_tokens_charged_total`` -- output tokens charged
  to the user's quota (net of refunds);
* ``vllm:output_rate_prompt_tokens_charged_total`` -- prompt tokens charged
  at ``input_token_weight`` (net of refunds; each costs the weight in quota
  tokens); a user's series appears with its first charged prompt token;
* ``vllm:output_rate_throttled_seconds_total`` -- time the user had runnable
  requests and no quota;
* ``vllm:output_rate_borrowed_tokens_total`` -- output tokens the user got
  on spare capacity beyond its rate (only while some user's ceiling is above
  its rate; also counted in ``..._output_tokens_charged_total``);
* ``vllm:output_rate_requests{state="active|throttled|waiting"}``;
* ``vllm:output_rate_limit_tokens_per_second``;
* ``vllm:output_rate_ceil_tokens_per_second`` (the rate for a hard cap,
  +Inf for ``ceil: null``), ``vllm:output_rate_weight``,
  ``vllm:output_rate_residency_cap_requests`` (+Inf: no cap) and
  ``vllm:output_rate_residency_held_requests`` (waiting requests the cap
  keeps out now);
* shadow mode: ``vllm:output_rate_shadow_held_tokens_total``,
  ``…_shadow_throttled_seconds_total``, ``…_shadow_borrowed_tokens_total``
  and the gauge ``…_shadow_residency_held_requests`` (see
  :mod:`vllm_output_rate.policy.shadow`); ``vllm:output_rate_mode{mode}``
  is 1 for the mode in force;

with groups (label ``group``): ``vllm:output_rate_group_output_tokens_charged_total``,
``…_group_prompt_tokens_charged_total``, ``…_group_borrowed_tokens_total``,
``…_group_requests{state}``, ``…_group_limit_tokens_per_second``,
``…_group_ceil_tokens_per_second``, ``…_group_weight``, the
``…_group_shadow_…`` series, and
``vllm:output_rate_user_group{user, group}`` (1: the user's group);

and engine-wide ``vllm:output_rate_throttled_requests`` (resident but held
for quota), ``vllm:output_rate_idle_steps_total`` (steps that ran nothing
because everything was throttled), ``vllm:output_rate_limit_reloads_total``,
``vllm:output_rate_limit_reload_failures_total``,
``vllm:output_rate_evictions_total`` (throttled requests preempted to make room
for other requests) and ``vllm:output_rate_eviction_recompute_tokens_total``
(the tokens they held: what their return recomputes at most).

Fairness, per engine (labels ``model_name`` and ``engine``, as vLLM's own
per-engine series: with data parallelism each engine has its own; see
:class:`~vllm_output_rate.policy.monitor.BorrowerFairness`), over the last
``vllm:output_rate_fairness_window_seconds`` (10 s):

* ``vllm:output_rate_fairness_jain_index`` -- Jain's index of output tokens /
  weight among the borrowers backlogged through the window (a request held
  for quota or waiting at every report in it; 1: equal
  weighted service; 1/n: one of n took it all; 1 with fewer than two);
* ``vllm:output_rate_fairness_service_gap_tokens`` -- the largest difference
  in output tokens / weight between two of them (0 with fewer than two);
* ``vllm:output_rate_fairness_backlogged_users`` -- how many there were
  (0 or 1: the index is 1 because nobody competed).

With a shared store (``--output-rate-store``), engine-wide (label
``model_name``; figures from
:meth:`~vllm_output_rate.stores.lease.LeasedOutputRateLimiter.figures`):

* ``vllm:output_rate_store_mode{mode="shared|local|closed"}`` -- 1 for the
  mode in force, 0 for the others;
* ``vllm:output_rate_store_outages_total``,
  ``vllm:output_rate_store_round_trips_total`` (answered),
  ``vllm:output_rate_store_failed_round_trips_total``,
  ``vllm:output_rate_store_commands_total`` (script calls sent: one per
  round trip on a single Redis, one per node on a cluster),
  ``vllm:output_rate_store_leased_tokens_total``,
  ``vllm:output_rate_store_spent_tokens_total`` (leased tokens the scheduler
  charged, net of refunds),
  ``vllm:output_rate_store_returned_tokens_total`` (unspent tokens handed
  back), ``vllm:output_rate_store_expired_tokens_total`` (leased tokens
  whose lease ran out unspent; handed back with the next round, or dropped
  if an outage starts first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_output_rate.adapter.install import add_field, wrap
from vllm_output_rate.policy.monitor import (
    ACTIVE,
    BORROWED,
    CEIL,
    CHARGED,
    FAIRNESS_KEYS,
    LIMIT,
    PROMPT,
    RESIDENCY_CAP,
    RESIDENCY_HELD,
    SHADOW_BORROWED,
    SHADOW_HELD,
    SHADOW_RESIDENCY_HELD,
    SHADOW_THROTTLED_S,
    THROTTLED,
    THROTTLED_S,
    WAITING,
    WEIGHT,
)
from vllm_output_rate.settings import MODES as OUTPUT_RATE_MODES
from vllm_output_rate.stores.backend import MODES as STORE_MODES

PREFIX = "vllm:output_rate_"
STATS_FIELD = "output_rate"
STATES = ("active", "throttled", "waiting")
#: Store counters: report key (an increment) -> (series name, help).
STORE_COUNTERS = {
    "store_outages_total": ("store_outages", "Times the shared store stopped answering "
                            "and the engine fell back (--output-rate-store-fallback)."),
    "store_round_trips_total": ("store_round_trips", "Lease round trips the shared store answered."),
    "store_failed_round_trips_total": ("store_failed_round_trips",
                                       "Lease round trips that failed or timed out."),
    "store_commands_total": ("store_commands", "Commands sent to the shared store (script "
                             "calls: one per round trip, one per node on a Redis Cluster)."),
    "store_leased_tokens_total": ("store_leased_tokens", "Tokens leased from the shared store."),
    "store_spent_tokens_total": ("store_spent_tokens",
                                 "Leased tokens the scheduler spent (net of refunds)."),
    "store_returned_tokens_total": ("store_returned_tokens",
                                    "Unspent leased tokens handed back to the shared store."),
    "store_expired_tokens_total": ("store_expired_tokens",
                                   "Leased tokens whose lease ran out unspent (handed back "
                                   "with the next answered round)."),
}


#: Fairness gauges: report key (``report["fairness"]``) -> (series name, help).
FAIRNESS_GAUGES = {
    "window_s": ("fairness_window_seconds",
                 "Length of the sliding window the fairness gauges are taken over (s)."),
    "backlogged_users": ("fairness_backlogged_users",
                         "Borrowers (ceiling above rate) with a request held for quota or waiting "
                         "at every report of the fairness window; 0 or 1: nobody competed."),
    "jain_index": ("fairness_jain_index",
                   "Jain's index of output tokens / weight among the backlogged borrowers over "
                   "the window: 1 equal weighted service, 1/n one took all (1 with fewer than two)."),
    "service_gap_tokens": ("fairness_service_gap_tokens",
                           "Largest difference of output tokens / weight between two backlogged "
                           "borrowers over the window (0 with fewer than two)."),
}
assert set(FAIRNESS_GAUGES) == set(FAIRNESS_KEYS)


def install_stats_field() -> None:
    """Add the optional ``output_rate`` field to vLLM's ``SchedulerStats`` (once)."""
    from vllm.v1.metrics.stats import SchedulerStats

    add_field(SchedulerStats, STATS_FIELD, dict[str, Any] | None, None)


@dataclass(frozen=True)
class HolderHelp:
    """Help texts of one kind of quota holder's series (a user, a group)."""

    charged: str
    prompt_charged: str
    borrowed: str
    requests: str
    limit: str
    throttled_seconds: str | None = None  # users only


USER_HELP = HolderHelp(
    charged="Output tokens charged to the user's quota (net of refunds).",
    prompt_charged="Prompt tokens charged to the user's quota at the input token weight "
    "(computed ones only; net of refunds).",
    throttled_seconds="Seconds during which the user had runnable requests and no quota.",
    borrowed="Output tokens the user got on spare capacity beyond its rate, up to its "
    "ceiling (also counted in output_tokens_charged).",
    requests="The user's requests: active (ran in the last step), throttled (resident, "
    "held for quota), waiting (not yet admitted).",
    limit="The user's configured output-token rate.",
)
GROUP_HELP = HolderHelp(
    charged="Output tokens charged to the group's users (net of refunds).",
    prompt_charged="Prompt tokens charged to the group's users at the input token weight.",
    borrowed="Output tokens the group's users got on spare capacity beyond their guaranteed rates.",
    requests="The group's users' requests: active, throttled, waiting.",
    limit="The group's configured output-token rate (all of its users together).",
)


class HolderSeries:
    """The series every quota holder of one kind has, labelled ``model_name``
    and ``label`` (``user`` or ``group``; ``requests`` also ``state``), named
    ``PREFIX + infix + ...``; and each engine's last request counts, since
    several engines (data-parallel ranks) report to one logger and the
    request gauges export their sum."""

    def __init__(self, model: str, registry: Any, label: str, infix: str, helps: HolderHelp) -> None:
        from prometheus_client import Counter, Gauge

        labels = ["model_name", label]
        self._model = model
        #: engine index -> holder -> (active, throttled, waiting), last reported.
        self._per_engine: dict[int, dict[str, tuple]] = {}
        # Declared in the order /metrics has always listed them.
        self.charged = Counter(f"{PREFIX}{infix}output_tokens_charged", helps.charged, labels, registry=registry)
        self.prompt_charged = Counter(
            f"{PREFIX}{infix}prompt_tokens_charged", helps.prompt_charged, labels, registry=registry
        )
        self.throttled_seconds = None if helps.throttled_seconds is None else Counter(
            f"{PREFIX}{infix}throttled_seconds", helps.throttled_seconds, labels, registry=registry
        )
        self.borrowed = Counter(f"{PREFIX}{infix}borrowed_tokens", helps.borrowed, labels, registry=registry)
        self.requests = Gauge(
            f"{PREFIX}{infix}requests", helps.requests,
            [*labels, "state"], registry=registry, multiprocess_mode="mostrecent",
        )
        self.limit = Gauge(
            f"{PREFIX}{infix}limit_tokens_per_second", helps.limit,
            labels, registry=registry, multiprocess_mode="mostrecent",
        )

    def feed(self, engine_idx: int, holder: str, row: list) -> None:
        """Add one engine's report row (:mod:`~vllm_output_rate.policy.monitor`'s layout) for ``holder``."""
        model = self._model
        child = self.charged.labels(model, holder)  # the series exists from the start
        if row[CHARGED]:
            child.inc(row[CHARGED])
        if len(row) > PROMPT and row[PROMPT]:
            self.prompt_charged.labels(model, holder).inc(row[PROMPT])
        if self.throttled_seconds is not None:
            child = self.throttled_seconds.labels(model, holder)
            if row[THROTTLED_S]:
                child.inc(row[THROTTLED_S])
        self._per_engine.setdefault(engine_idx, {})[holder] = (row[ACTIVE], row[THROTTLED], row[WAITING])
        self._set_request_gauges(holder)
        if row[LIMIT] is not None:
            self.limit.labels(model, holder).set(row[LIMIT])
        if len(row) > BORROWED:  # some user may borrow
            child = self.borrowed.labels(model, holder)
            if row[BORROWED]:
                child.inc(row[BORROWED])

    def drop(self, engine_idx: int, holder: str) -> None:
        """Engine ``engine_idx`` no longer reports ``holder``: its series go
        once no engine does; until then the gauges sum the others."""
        self._per_engine.setdefault(engine_idx, {}).pop(holder, None)
        if any(holder in rows for rows in self._per_engine.values()):
            self._set_request_gauges(holder)
            return
        for metric in (self.charged, self.throttled_seconds, self.limit, self.prompt_charged, self.borrowed):
            if metric is not None:
                _remove(metric, self._model, holder)
        for state in STATES:
            _remove(self.requests, self._model, holder, state)

    def _set_request_gauges(self, holder: str) -> None:
        rows = [rows[holder] for rows in self._per_engine.values() if holder in rows]
        for i, state in enumerate(STATES):
            self.requests.labels(self._model, holder, state).set(sum(row[i] for row in rows))


class HolderExtras:
    """The limit and shadow series of one kind of holder (see the module
    doc), fed from a report's ``limits`` and ``shadow`` rows
    (``policy/monitor.py``'s CEIL and SHADOW_HELD layouts).

    A ceiling or a residency cap the holder does not have is +Inf (no
    bound); ``residency`` is False for groups (no cap of their own).
    Several engines' residency gauges export their sum, as the request
    gauges do.
    """

    def __init__(self, model: str, registry: Any, label: str, infix: str, residency: bool) -> None:
        from prometheus_client import Counter, Gauge

        labels = ["model_name", label]
        self._model = model
        #: engine index -> holder -> (held by its cap, shadow residency), last reported.
        self._per_engine: dict[int, dict[str, list[int]]] = {}
        name = f"{PREFIX}{infix}"
        who = "user" if label == "user" else "group"

        def gauge(suffix: str, text: str) -> Any:
            return Gauge(f"{name}{suffix}", text, labels, registry=registry,
                         multiprocess_mode="mostrecent")

        def counter(suffix: str, text: str) -> Any:
            return Counter(f"{name}{suffix}", text, labels, registry=registry)

        self.ceil = gauge("ceil_tokens_per_second",
                          f"The {who}'s ceiling (tok/s): its rate for a hard cap, +Inf without a ceiling.")
        self.weight = gauge("weight", f"The {who}'s borrowing weight (its rate unless configured).")
        self.residency_cap = self.residency_held = None
        if residency:
            self.residency_cap = gauge(
                "residency_cap_requests",
                "Requests the user may hold resident (KV): max(1, floor(top rate / minimum pace)); "
                "+Inf without a cap.",
            )
            self.residency_held = gauge(
                "residency_held_requests",
                "The user's waiting requests its residency cap keeps out now (enforce mode).",
            )
        self.shadow_held = counter(
            "shadow_held_tokens", f"Shadow mode: tokens the {who}'s limit would have held back.")
        self.shadow_throttled = counter(
            "shadow_throttled_seconds", f"Shadow mode: seconds the {who} would have been throttled.")
        self.shadow_borrowed = counter(
            "shadow_borrowed_tokens",
            f"Shadow mode: tokens the {who} would have borrowed beyond its rate, up to its ceiling.")
        self.shadow_residency = gauge(
            "shadow_residency_held_requests",
            f"Shadow mode: resident requests of the {who} its residency cap would have kept waiting.")

    def feed(self, engine_idx: int, holder: str, limits: list | None, shadow: list | None) -> None:
        model = self._model
        gauges = self._per_engine.setdefault(engine_idx, {}).setdefault(holder, [0, 0])
        if limits is not None:
            if limits[WEIGHT] is not None:
                ceil = limits[CEIL]
                self.ceil.labels(model, holder).set(float("inf") if ceil is None else ceil)
                self.weight.labels(model, holder).set(limits[WEIGHT])
                if self.residency_cap is not None:
                    cap = limits[RESIDENCY_CAP]
                    self.residency_cap.labels(model, holder).set(float("inf") if cap is None else cap)
            gauges[0] = limits[RESIDENCY_HELD]
            if self.residency_held is not None:
                self.residency_held.labels(model, holder).set(self._sum(holder, 0))
        if shadow is not None:
            for metric, i in ((self.shadow_held, SHADOW_HELD),
                              (self.shadow_throttled, SHADOW_THROTTLED_S),
                              (self.shadow_borrowed, SHADOW_BORROWED)):
                child = metric.labels(model, holder)  # the series exists from the start
                if shadow[i]:
                    child.inc(shadow[i])
            gauges[1] = shadow[SHADOW_RESIDENCY_HELD]
            self.shadow_residency.labels(model, holder).set(self._sum(holder, 1))

    def _sum(self, holder: str, i: int) -> int:
        return sum(rows[holder][i] for rows in self._per_engine.values() if holder in rows)

    def drop(self, engine_idx: int, holder: str) -> None:
        self._per_engine.setdefault(engine_idx, {}).pop(holder, None)
        if any(holder in rows for rows in self._per_engine.values()):
            return
        for metric in (self.ceil, self.weight, self.residency_cap, self.residency_held,
                       self.shadow_held, self.shadow_throttled, self.shadow_borrowed,
                       self.shadow_residency):
            if metric is not None:
                _remove(metric, self._model, holder)


class OutputRateExporter:
    """Prometheus series fed from per-user reports."""

    def __init__(self, model_name: str, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self._model = str(model_name)
        #: engine index -> throttled requests, last reported.
        self._throttled_of: dict[int, int] = {}
        self.users = HolderSeries(self._model, registry, "user", "", USER_HELP)
        self.user_extras = HolderExtras(self._model, registry, "user", "", residency=True)
        self.groups = GroupSeries(self._model, registry)
        self.mode = Gauge(
            f"{PREFIX}mode",
            "1 for the mode in force: enforce (the policy decides) or shadow (stock vLLM "
            "decides; the shadow_* series count what the policy would have done).",
            ["model_name", "mode"], registry=registry, multiprocess_mode="mostrecent",
        )
        self.throttled_requests = Gauge(
            f"{PREFIX}throttled_requests",
            "Requests resident in the engine but held for their user's quota "
            "(vllm:num_requests_running counts them as running).",
            ["model_name"], registry=registry, multiprocess_mode="mostrecent",
        )
        self.idle_steps = Counter(
            f"{PREFIX}idle_steps",
            "Engine steps that ran nothing because every runnable request was throttled.",
            ["model_name"], registry=registry,
        )
        self.reloads = Counter(
            f"{PREFIX}limit_reloads",
            "Limits-file reloads applied.", ["model_name"], registry=registry,
        )
        self.reload_failures = Counter(
            f"{PREFIX}limit_reload_failures",
            "Limits-file versions rejected (old limits stayed).", ["model_name"], registry=registry,
        )
        self.evictions = Counter(
            f"{PREFIX}evictions",
            "Throttled requests preempted to make room (KV or a slot) for other requests.",
            ["model_name"], registry=registry,
        )
        self.eviction_recompute_tokens = Counter(
            f"{PREFIX}eviction_recompute_tokens",
            "Tokens held by evicted requests: at most what their return recomputes "
            "(paid from --output-rate-recompute-budget).",
            ["model_name"], registry=registry,
        )
        self.store_mode = Gauge(
            f"{PREFIX}store_mode",
            "Where quota comes from: 1 for the mode in force (shared: the shared store; "
            "local / closed: its fallback while the store does not answer).",
            ["model_name", "mode"], registry=registry, multiprocess_mode="mostrecent",
        )
        self.store_counters = {
            key: Counter(f"{PREFIX}{name}", text, ["model_name"], registry=registry)
            for key, (name, text) in STORE_COUNTERS.items()
        }
        # Per engine, not summed: an index of two engines' users is no sum of theirs.
        self.fairness = {
            key: Gauge(f"{PREFIX}{name}", text, ["model_name", "engine"], registry=registry,
                       multiprocess_mode="mostrecent")
            for key, (name, text) in FAIRNESS_GAUGES.items()
        }

    def observe(self, report: dict, engine_idx: int = 0) -> None:
        """Feed one engine's report.  Several engines (data-parallel ranks)
        report to one logger: counters add up by themselves; the gauges are
        kept per engine and exported as their sum."""
        model = self._model
        for user in report.get("removed", ()):
            self.users.drop(engine_idx, user)
            self.user_extras.drop(engine_idx, user)
        limits, shadow = report.get("limits", {}), report.get("shadow", {})
        for user, row in report.get("users", {}).items():
            self.users.feed(engine_idx, user, row)
            self.user_extras.feed(engine_idx, user, limits.get(user), shadow.get(user))
        if "mode" in report:
            for mode in OUTPUT_RATE_MODES:
                self.mode.labels(model, mode).set(1 if report["mode"] == mode else 0)
        if "groups" in report:  # groups are (or were) configured
            self.groups.observe(report, engine_idx)
        engine = report.get("engine", {})
        self._throttled_of[engine_idx] = engine.get("throttled_requests", 0)
        self.throttled_requests.labels(model).set(sum(self._throttled_of.values()))
        for metric, key in (
            (self.idle_steps, "idle_steps_total"),
            (self.reloads, "reloads_total"),
            (self.reload_failures, "reload_failures_total"),
            (self.evictions, "evictions_total"),
            (self.eviction_recompute_tokens, "eviction_recompute_tokens_total"),
        ):
            child = metric.labels(model)
            if engine.get(key):
                child.inc(engine[key])
        fairness = report.get("fairness")
        if fairness is not None:
            for key, gauge in self.fairness.items():
                if key in fairness:
                    gauge.labels(model, str(engine_idx)).set(fairness[key])
        if "store_mode" in engine:  # a shared store is configured
            for code, mode in enumerate(STORE_MODES):
                self.store_mode.labels(model, mode).set(1 if engine["store_mode"] == code else 0)
            for key, counter in self.store_counters.items():
                child = counter.labels(model)
                if engine.get(key):
                    child.inc(engine[key])


class GroupSeries:
    """The per-group series (label ``group``) and each user's group
    (``user_group{user, group}`` = 1), fed from a report's ``groups``,
    ``groups_removed`` and ``user_groups``: rows as users' rows."""

    def __init__(self, model: str, registry: Any) -> None:
        from prometheus_client import Gauge

        self._model = model
        #: user -> the group its user_group series names.
        self._user_group: dict[str, str] = {}
        self.series = HolderSeries(model, registry, "group", "group_", GROUP_HELP)
        self.extras = HolderExtras(model, registry, "group", "group_", residency=False)
        self.user_group = Gauge(
            f"{PREFIX}user_group",
            "1 for the group the user belongs to (users with a series and a group).",
            ["model_name", "user", "group"], registry=registry, multiprocess_mode="mostrecent",
        )

    def observe(self, report: dict, engine_idx: int) -> None:
        model = self._model
        for group in report.get("groups_removed", ()):
            self.series.drop(engine_idx, group)
            self.extras.drop(engine_idx, group)
        limits, shadow = report.get("group_limits", {}), report.get("group_shadow", {})
        for group, row in report["groups"].items():
            self.series.feed(engine_idx, group, row)
            self.extras.feed(engine_idx, group, limits.get(group), shadow.get(group))
        user_groups = report.get("user_groups", {})
        removed = set(report.get("removed", ()))
        for user in set(report.get("users", ())) | removed:
            group = None if user in removed else user_groups.get(user)
            before = self._user_group.get(user)
            if before == group:
                continue
            if before is not None:
                _remove(self.user_group, model, user, before)
                del self._user_group[user]
            if group is not None:
                self.user_group.labels(model, user, group).set(1)
                self._user_group[user] = group


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def install_prometheus_export() -> None:
    """``PrometheusStatLogger.record`` also exports the per-user report (once)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    wrap(PrometheusStatLogger, "record", _make_record)


def _make_record(original):
    def record(self, scheduler_stats, *args, **kwargs):
        original(self, scheduler_stats, *args, **kwargs)
        report = getattr(scheduler_stats, STATS_FIELD, None)
        if report is not None:
            exporter = self.__dict__.get("_output_rate_exporter")
            if exporter is None:
                # One exporter per vLLM logger: a new PrometheusStatLogger
                # unregisters every "vllm:" collector, ours included.
                exporter = OutputRateExporter(self.vllm_config.model_config.served_model_name)
                self._output_rate_exporter = exporter
            engine_idx = kwargs.get("engine_idx", args[2] if len(args) > 2 else 0)
            exporter.observe(report, engine_idx)

    return record
