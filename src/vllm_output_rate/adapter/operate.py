"""Scheduler-side operation: live limit reloads, per-user stats, admin snapshot.

:class:`OperateSchedulerMixin` comes first in the bases of the plugin's
scheduler classes.  Per step it costs one attribute test (is a reload
pending?) and one clock comparison; everything per user happens about once a
second:

* **Reload.**  With ``--output-rate-limits-file``, a daemon thread checks the
  file every half second.  A changed file is parsed and validated whole
  (:func:`~vllm_output_rate.settings.load_limits_file`); a good one is handed
  to the next ``schedule()`` call, which applies it with
  the limiter's ``update_rates`` before planning the step (users whose
  rate did not change keep their quota state exactly).  A bad one is logged
  and counted; the old limits stay.  Any failure to load the file counts
  (not only a refused setting), once per file version and reason, and the
  file is not taken as seen: it is read again at every check until it loads
  (a fix that keeps the file's signature, such as a ``chmod``, is applied).
* **Stats.**  ``make_stats()`` (vLLM calls it after every step) attaches a
  per-user report (:class:`~vllm_output_rate.policy.monitor.UserMonitor`) to
  ``SchedulerStats.output_rate`` at most once a second, and at once when the
  engine has just become empty (so gauges fall back to 0).
* **Admin.**  :meth:`output_rate_users` answers ``GET /v1/output_rate/users``
  (reached as an engine-core utility, see :mod:`.admin`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from vllm_output_rate.policy.monitor import (
    OTHER_USERS,
    ChargeHistory,
    GroupTotals,
    ShadowTotals,
    UserMonitor,
)
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.policy.shadow import residency_surplus
from vllm_output_rate.settings import (
    CONFIG_KEY,
    ENFORCE,
    INPUT_TOKEN_WEIGHT_KEY,
    MIN_PACE_KEY,
    MODE_KEY,
    SHADOW,
    OutputRateConfigError,
    OutputRateSettings,
    file_signature,
    limits_view,
    load_limits_version,
)

logger = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
#: Period of per-user reports and of the charge history (ns).
REPORT_PERIOD_NS = NS_PER_S
#: Users idle this long are dropped from the per-user totals (s); longer
#: than the admin route's 10 s window.
FORGET_IDLE_S = 30.0
#: How often the limits file is checked for changes (s).
FILE_CHECK_S = 0.5
#: Reload records the admin route keeps (the oldest go first).
AUDIT_KEEP = 100


class LimitsFileWatcher:
    """Checks a limits file for changes; validated new settings go to ``on_good``."""

    def __init__(
        self,
        path: str,
        on_good: Callable[[OutputRateSettings], None],
        on_bad: Callable[[str], None],
        interval_s: float = FILE_CHECK_S,
        input_token_weight: float = 0.0,
        min_pace: float = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
        mode: str = ENFORCE,
    ) -> None:
        self.path = path
        #: The mode a file without ``mode`` means (the flag's).
        self.mode = mode
        #: SHA-256 of the version last loaded (set before ``on_good`` runs).
        self.digest: str | None = None
        #: The weight a file without ``input_token_weight`` means (the flag's).
        self.input_token_weight = input_token_weight
        #: The pace a file without ``min_stream_tokens_per_second`` means.
        self.min_pace = min_pace
        self._on_good = on_good
        self._on_bad = on_bad
        self._interval_s = interval_s
        self._signature = file_signature(path)  # of the version in force
        #: (signature, reason) of the last failure reported: reported once.
        self._failed: tuple[object, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Look at the file once; True when it was applied or newly rejected.

        The signature advances only when the file was loaded: a file that
        failed (in any way) is read again at the next check, its failure
        reported once per (signature, reason).
        """
        signature = file_signature(self.path)
        if signature == self._signature:
            return False
        try:
            settings, digest = load_limits_version(
                self.path, self.input_token_weight, self.min_pace, self.mode
            )
        except Exception as exc:  # any failure is a rejected file, never a dead watcher
            reason = str(exc) if isinstance(exc, OutputRateConfigError) else (
                f"{self.path!r}: {type(exc).__name__}: {exc}"
            )
            reason = " ".join(reason.split())  # one line
            if self._failed == (signature, reason):
                return False
            self._failed = (signature, reason)
            self._on_bad(reason)
            return True
        self._signature = signature
        self._failed = None
        self.digest = digest
        self._on_good(settings)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="vllm-output-rate-limits", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # never let the watcher die silently
                logger.exception("vllm-output-rate: checking %s failed", self.path)


#: Most limits one warning names (a file of thousands of users stays one readable line).
WARN_NAMES = 10


def _warn_inert_weights(settings: OutputRateSettings) -> None:
    inert = settings.inert_weights()
    if inert:
        named = ", ".join(inert[:WARN_NAMES])
        if len(inert) > WARN_NAMES:
            named += f" and {len(inert) - WARN_NAMES} more"
        logger.warning(
            "vllm-output-rate: a weight does nothing without a ceiling above the rate "
            "(these never borrow; \"ceil\": null borrows without a ceiling): %s", named,
        )


class OperateSchedulerMixin:
    """Reload, stats and admin snapshot; list it before ``OutputRateSchedulerMixin``."""

    #: Wall-free monotonic clock for reports (ns); tests replace it.
    output_rate_operate_clock: Callable[[], int] = staticmethod(time.monotonic_ns)
    #: None until our ``__init__`` ran; a scheduler built without it (vLLM's
    #: own tests use ``object.__new__``) schedules, reports and stops as stock.
    _operate: OperateState | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings: OutputRateSettings = self.output_rate_settings
        self.output_rate_reloads = 0
        self.output_rate_reload_failures = 0
        self._operate = operate = OperateState(settings.metrics_max_users)
        _warn_inert_weights(settings)
        if settings.limits_file:
            section = self.vllm_config.additional_config[CONFIG_KEY]
            operate.watcher = LimitsFileWatcher(
                settings.limits_file, self._limits_changed, self._limits_rejected,
                input_token_weight=section.get(INPUT_TOKEN_WEIGHT_KEY, 0.0),
                min_pace=section.get(MIN_PACE_KEY, DEFAULT_MIN_STREAM_TOKENS_PER_SECOND),
                mode=section.get(MODE_KEY, ENFORCE),
            )
            operate.audit.started(settings.limits_file, settings.limits_digest)
            operate.watcher.start()

    # -- reload ----------------------------------------------------------------

    def _limits_changed(self, new: OutputRateSettings) -> None:
        # Called on the watcher thread: only hand over; the engine thread applies.
        watcher = self._operate.watcher
        self._operate.pending = (new, None if watcher is None else watcher.digest)

    def _limits_rejected(self, reason: str) -> None:
        self.output_rate_reload_failures += 1
        logger.error("vllm-output-rate: limits file rejected, old limits stay in force: %s", reason)
        self._operate.audit.rejected(reason)

    def apply_output_rate_limits(self, new: OutputRateSettings, digest: str | None = None) -> None:
        """Switch to ``new`` limits now (engine thread, between steps);
        ``digest``: the file version they come from, for the audit trail."""
        before = limits_view(self.output_rate_settings)
        changed = self.output_rate_limiter.update_rates(new.default_rate, new.user_rates)
        settings = dataclasses.replace(
            self.output_rate_settings, default_rate=new.default_rate, user_rates=dict(new.user_rates),
            input_token_weight=new.input_token_weight,
            default_share=new.default_share, user_shares=dict(new.user_shares),
            group_rates=dict(new.group_rates), group_shares=dict(new.group_shares),
            user_groups=dict(new.user_groups), default_group=new.default_group,
            min_stream_tokens_per_second=new.min_stream_tokens_per_second,
            user_min_stream_tokens_per_second=dict(new.user_min_stream_tokens_per_second),
            mode=new.mode,
            limits_digest=digest or new.limits_digest,
        )
        # Caps follow the new limits (streams now beyond them give way first),
        # and so do ceilings, groups and the prompt cost's weight.
        self.configure(settings)
        self.output_rate_reloads += 1
        _warn_inert_weights(settings)
        logger.info(
            "vllm-output-rate: limits reloaded (default %s tok/s, %d override(s), %d group(s), "
            "input token weight %s; %d active user(s) changed rate)",
            new.default_rate, len(new.user_rates), len(new.group_rates), new.input_token_weight,
            len(changed),
        )
        self._operate.audit.applied(before, limits_view(settings), settings.limits_digest)

    def schedule(self, *args: Any, **kwargs: Any):
        if self._operate is not None:
            self.output_rate_operate_step()
        return super().schedule(*args, **kwargs)

    def output_rate_operate_step(self) -> None:
        """Before a step: apply a reload the watcher handed over, and sample
        the charge history when its period is due."""
        operate = self._operate
        pending = operate.pending
        if pending is not None:
            operate.pending = None
            self.apply_output_rate_limits(*pending)
        now = self.output_rate_operate_clock()
        if now >= operate.next_tick:
            operate.next_tick = now + REPORT_PERIOD_NS
            operate.history.record(now, self._output_rate_charged())

    def shutdown(self) -> None:
        if self._operate is not None and self._operate.watcher is not None:
            self._operate.watcher.stop()
        super().shutdown()

    # -- stats -------------------------------------------------------------------

    def make_stats(self, *args: Any, **kwargs: Any):
        stats = super().make_stats(*args, **kwargs)
        if stats is None or self._operate is None:
            return stats
        now = self.output_rate_operate_clock()
        busy = bool(self.running) or bool(self.waiting)
        operate = self._operate
        was_busy = operate.was_busy
        operate.was_busy = busy
        # Also report at once when the engine just emptied: gauges go back
        # to 0 and the last charges are counted before the engine idles.
        if now >= operate.next_report or (was_busy and not busy):
            operate.next_report = now + REPORT_PERIOD_NS
            try:
                stats.output_rate = self.output_rate_report(now)
            except Exception:  # metrics must never take the engine down
                logger.exception("vllm-output-rate: per-user report failed; reports are off")
                operate.next_report = float("inf")
        return stats

    def _output_rate_charged(self) -> dict[str, int]:
        """Tokens charged per user, cumulative; with shadow mode on now or
        before, plus the tokens stock vLLM gave while shadowing (nothing
        was charged then, everything would have been)."""
        charged = self.output_rate_gate.ledger.charged_tokens
        shadow = getattr(self, "output_rate_shadow", None)
        if shadow is None or not shadow.sampled:
            return charged
        merged = dict(charged)
        for user, tokens in shadow.sampled.items():
            merged[user] = merged.get(user, 0) + tokens
        return merged

    def output_rate_counts(self) -> dict[str, tuple[int, int, int]]:
        """user -> (active, throttled, waiting) requests now (while
        shadowing, every resident request is active: nothing is held)."""
        gate = self.output_rate_gate
        counts: dict[str, list[int]] = {}
        if shadowing(self):
            for user, lane in gate.lanes.order.items():
                if len(lane):
                    counts[user] = [len(lane), 0, 0]
        elif self.running:  # else the last step's users have all left
            for user, (ran, held) in gate.last_step_users().items():
                counts[user] = [ran, held, 0]
        user_of = gate.lanes.user_of
        for request in self.waiting:
            user = user_of.get(request)
            if user is not None:
                counts.setdefault(user, [0, 0, 0])[2] += 1
        return {user: tuple(c) for user, c in counts.items()}

    def output_rate_report(self, now_ns: int) -> dict:
        ledger = self.output_rate_gate.ledger
        settings = self.output_rate_settings
        counts = self.output_rate_counts()
        monitor = self._operate.monitor
        held, surplus = residency_now(self, counts)
        report = monitor.report(
            now_ns,
            charged=self._output_rate_charged(),
            throttled_ns=ledger.throttled_ns,
            counts=counts,
            configured=settings.user_rates,
            rate_of=settings.rate_of,
            prompt_charged=self.output_rate_prompt_cost.prompt_tokens,
            borrowed=_borrowed_tokens(self.output_rate_gate),
            engine={
                "throttled_requests": sum(c[1] for c in counts.values()),
                "idle_steps_total": self.output_rate_gate.idle_steps,
                **_eviction_totals(self),
                "reloads_total": self.output_rate_reloads,
                "reload_failures_total": self.output_rate_reload_failures,
                # Shared-store mode and totals (only with --output-rate-store).
                **self.output_rate_limiter.figures(),
            },
            limits_of=user_limits(self, held),
            shadow=shadow_totals(self, surplus),
        )
        report["mode"] = settings.mode
        self._operate.group_reports.add_to(report, self, now_ns, counts, surplus)
        # Users idle for a while are forgotten, so the per-user totals (and
        # this step's work) stay bounded by the users active recently, not by
        # every name ever seen.  Their reported counters are unaffected.
        forgotten = monitor.idle_users(now_ns, FORGET_IDLE_S)
        if forgotten:
            prompt_totals = self.output_rate_prompt_cost.prompt_tokens
            borrowed = _borrowed_tokens(self.output_rate_gate) or {}
            ledger.forget_totals(forgotten)
            for totals in (prompt_totals, borrowed):
                for user in forgotten:
                    totals.pop(user, None)
            shadow = getattr(self, "output_rate_shadow", None)
            if shadow is not None:
                shadow.forget(forgotten)
            monitor.forget(forgotten)
        return report

    # -- admin (engine-core utility) ----------------------------------------------

    def output_rate_users(self) -> dict:
        """Per-user state for ``GET /v1/output_rate/users``."""
        now = self.output_rate_operate_clock()
        settings = self.output_rate_settings
        limiter = self.output_rate_limiter
        counts = self.output_rate_counts()
        charged = self._output_rate_charged()
        prompt_charged = self.output_rate_prompt_cost.prompt_tokens
        users = set(counts) | set(settings.user_rates)
        history = self._operate.history
        users.update(u for u, n in history.tokens_in_window(now, charged, charged).items() if n)
        recent = history.tokens_in_window(now, charged, users)
        throttled_ns = self.output_rate_gate.ledger.throttled_ns
        borrowed = _borrowed_tokens(self.output_rate_gate) or {}
        limiter_now = self.output_rate_clock()
        groups = getattr(self, "output_rate_groups", None)
        group_quota = None if groups is None else groups.guaranteed()
        residency = getattr(self, "output_rate_residency", None)
        held, surplus = residency_now(self, counts)
        shadow = shadow_totals(self, surplus)
        rows = {}
        for user in sorted(users):
            active, throttled, waiting = counts.get(user, (0, 0, 0))
            ready_ns = limiter.ready_at_ns(user, limiter_now)
            group = None if groups is None else groups.of(user)
            if group is not None:  # its group's quota must pay too
                ready_ns = max(ready_ns, group_quota.ready_at_ns(group, limiter_now))
            rate, ceil, weight = settings.limit_of(user)
            rows[user] = {
                "rate": rate,
                "ceil": ceil,
                "weight": weight,
                "tokens_borrowed_total": borrowed.get(user, 0),
                "configured": user in settings.user_rates,
                "tokens_last_10s": recent.get(user, 0),
                "tokens_charged_total": charged.get(user, 0),
                "prompt_tokens_charged_total": prompt_charged.get(user, 0),
                "throttled_seconds_total": throttled_ns.get(user, 0) / NS_PER_S,
                "active": active,
                "throttled": throttled,
                "waiting": waiting,
                "ready_in_s": max(0, ready_ns - limiter_now) / NS_PER_S,
                "residency_cap": None if residency is None else residency.cap(user),
                "residency_held": held.get(user, 0),
            }
            shadowed = shadow_row(shadow, user, surplus.get(user, 0))
            if shadowed is not None:
                rows[user]["shadow"] = shadowed
            store = limiter.figures(user)
            if store:  # with a shared store: this engine's lease totals for the user
                rows[user]["store"] = store
        if groups is not None:
            for user, row in rows.items():
                row["group"] = groups.of(user)
        audit = self._operate.audit
        return {
            "mode": settings.mode,
            "groups": self._operate.group_reports.admin_rows(self, rows, recent, limiter_now, surplus),
            "default_rate": settings.default_rate,
            "input_token_weight": settings.input_token_weight,
            "burst_seconds": settings.burst_seconds,
            "default_ceil": settings.default_limit()[1],
            "default_weight": settings.default_limit()[2],
            "limits_file": settings.limits_file,
            "reloads": self.output_rate_reloads,
            "reload_failures": self.output_rate_reload_failures,
            "limits_digest": audit.digest,
            "audit": audit.entries(),
            "users": rows,
        }


class OperateState:
    """What operation keeps between steps: the per-user and per-group
    report monitors, the charge history of the admin route's window, the
    limits-file watcher and a reload it handed over, and when to report."""

    def __init__(self, metrics_max_users: int) -> None:
        self.monitor = UserMonitor(metrics_max_users)
        self.group_reports = GroupReports()
        self.history = ChargeHistory()
        self.watcher: LimitsFileWatcher | None = None
        #: Settings the watcher validated and their file's digest, applied
        #: before the next step.
        self.pending: tuple[OutputRateSettings, str | None] | None = None
        self.audit = LimitsAudit()
        self.next_tick = 0  # next charge-history sample (operate clock, ns)
        self.next_report = 0  # next per-user report
        self.was_busy = False  # the engine had requests at the last report check


class GroupReports:
    """Per-group metrics rows and admin rows, summed from the users' totals.

    ``engine`` is the scheduler (its groups, settings, ledger, prompt cost and
    borrowing).  The group series use a second
    :class:`~vllm_output_rate.policy.monitor.UserMonitor`, created with the
    first groups (at start or on a reload) and kept after them, so that the
    series of groups a reload removed are dropped.
    """

    def __init__(self) -> None:
        self.monitor: UserMonitor | None = None
        self.totals = GroupTotals()

    def totals_now(self, engine: Any) -> dict[str, dict[str, int]]:
        """Cumulative per-group totals: charged, prompt and borrowed tokens."""
        groups = getattr(engine, "output_rate_groups", None)
        group_of = _no_group if groups is None else groups.of
        totals = self.totals
        totals.update("charged", engine._output_rate_charged(), group_of)
        totals.update("prompt", engine.output_rate_prompt_cost.prompt_tokens, group_of)
        totals.update("borrowed", _borrowed_tokens(engine.output_rate_gate) or {}, group_of)
        return totals.totals

    def add_to(
        self, report: dict, engine: Any, now_ns: int, counts: dict, surplus: dict | None = None
    ) -> None:
        """Per-group rows (``report["groups"]``, as users' rows) and each
        reported user's group (``report["user_groups"]``)."""
        groups = getattr(engine, "output_rate_groups", None)
        if groups is None and self.monitor is None:
            return
        settings = engine.output_rate_settings
        if self.monitor is None:
            self.monitor = UserMonitor(settings.metrics_max_users)
        totals = self.totals_now(engine)
        group_of = _no_group if groups is None else groups.of
        group_counts: dict[str, list[int]] = {}
        for user, state in counts.items():
            group = group_of(user)
            if group is not None:
                row = group_counts.setdefault(group, [0, 0, 0])
                for i, n in enumerate(state):
                    row[i] += n
        borrowing = _borrowed_tokens(engine.output_rate_gate) is not None
        rows = self.monitor.report(
            now_ns,
            charged=totals["charged"],
            throttled_ns={},
            counts={g: tuple(c) for g, c in group_counts.items()},
            configured=settings.group_rates,
            rate_of=settings.group_rates.get,
            prompt_charged=totals["prompt"],
            borrowed=totals["borrowed"] if borrowing else None,
            limits_of=_group_limits(settings),
            shadow=shadow_group_totals(engine, surplus or {}, group_of),
        )
        rows["users"].pop(OTHER_USERS, None)  # every group is a configured one
        report["groups"] = rows["users"]
        report["group_limits"] = rows.get("limits", {})
        report["group_limits"].pop(OTHER_USERS, None)
        if "shadow" in rows:
            rows["shadow"].pop(OTHER_USERS, None)
            report["group_shadow"] = rows["shadow"]
        report["groups_removed"] = rows["removed"]
        report["user_groups"] = {
            user: group for user in report["users"] if (group := group_of(user)) is not None
        }

    def admin_rows(
        self, engine: Any, user_rows: dict, recent: dict, now_ns: int, surplus: dict | None = None
    ) -> dict:
        """Per-group state for the admin route ({} without groups)."""
        groups = getattr(engine, "output_rate_groups", None)
        if groups is None:
            return {}
        settings = engine.output_rate_settings
        totals = self.totals_now(engine)
        members = groups.members()
        quota = groups.guaranteed()
        shadow = shadow_group_totals(engine, surplus or {}, groups.of)
        rows = {}
        for group in sorted(settings.group_rates):
            rate, ceil, weight = settings.group_limit_of(group)
            mine = [row for row in user_rows.values() if row.get("group") == group]
            rows[group] = {
                "rate": rate,
                "ceil": ceil,
                "weight": weight,
                "members": sorted(members.get(group, ())),
                "default_users": settings.default_group == group,
                "tokens_last_10s": sum(n for u, n in recent.items() if groups.of(u) == group),
                "tokens_charged_total": totals["charged"].get(group, 0),
                "prompt_tokens_charged_total": totals["prompt"].get(group, 0),
                "tokens_borrowed_total": totals["borrowed"].get(group, 0),
                "active": sum(row["active"] for row in mine),
                "throttled": sum(row["throttled"] for row in mine),
                "waiting": sum(row["waiting"] for row in mine),
                "ready_in_s": max(0, quota.ready_at_ns(group, now_ns) - now_ns) / NS_PER_S,
            }
            shadowed = shadow_row(
                shadow, group, 0 if shadow is None else shadow.residency_held.get(group, 0)
            )
            if shadowed is not None:
                rows[group]["shadow"] = shadowed
        return rows


def _no_group(user: str) -> None:
    return None


def shadowing(engine: Any) -> bool:
    """Is shadow mode in force in ``engine`` (the scheduler)?"""
    return engine.output_rate_settings.mode == SHADOW


def _eviction_totals(engine: Any) -> dict[str, int]:
    budget = getattr(engine, "output_rate_eviction_budget", None)
    if budget is None:
        return {}
    return {
        "evictions_total": budget.evictions,
        "eviction_recompute_tokens_total": budget.spent_tokens,
    }


def residency_now(engine: Any, counts: dict[str, tuple[int, int, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """(user -> waiting requests its residency cap holds back now, user ->
    resident requests the cap would have kept waiting, while shadowing).

    Held back: the user's waiting requests beyond the room its cap leaves
    (cap - resident), whatever else they wait for, since with no room left
    the cap alone keeps them out.  Enforcement only: while shadowing stock
    vLLM admits them, and the second figure counts the resident ones beyond
    the cap instead."""
    residency = getattr(engine, "output_rate_residency", None)
    if residency is None:
        return {}, {}
    lanes = engine.output_rate_gate.lanes
    if shadowing(engine):
        resident = {user: len(lane) for user, lane in lanes.order.items() if len(lane)}
        return {}, residency_surplus(resident, residency.cap)
    held: dict[str, int] = {}
    for user, (_active, _throttled, waiting) in counts.items():
        if waiting:
            room = residency.room(user, lanes.resident_count(user))
            if room is not None and waiting > room:
                held[user] = waiting - room
    return held, {}


def user_limits(engine: Any, held: dict[str, int]) -> Callable[[str], list[Any]]:
    """``limits_of`` for the users' report rows (see ``policy/monitor.py``'s CEIL)."""
    settings = engine.output_rate_settings
    residency = getattr(engine, "output_rate_residency", None)

    def limits_of(user: str) -> list[Any]:
        _rate, ceil, weight = settings.limit_of(user)
        cap = None if residency is None else residency.cap(user)
        return [ceil, weight, cap, held.get(user, 0)]

    return limits_of


def shadow_totals(engine: Any, surplus: dict[str, int]) -> ShadowTotals | None:
    """The users' shadow totals, once shadow mode has counted (None before)."""
    shadow = getattr(engine, "output_rate_shadow", None)
    if shadow is None:
        return None
    users = shadow.users
    return ShadowTotals(users.held, users.throttled_ns, users.borrowed, surplus)


def shadow_group_totals(engine: Any, surplus: dict[str, int], group_of: Callable) -> ShadowTotals | None:
    """The groups' shadow totals (residency: the sum of the members')."""
    shadow = getattr(engine, "output_rate_shadow", None)
    if shadow is None:
        return None
    per_group: dict[str, int] = {}
    for user, count in surplus.items():
        group = group_of(user)
        if group is not None:
            per_group[group] = per_group.get(group, 0) + count
    groups = shadow.groups
    if groups is None:
        return ShadowTotals(residency_held=per_group)
    return ShadowTotals(groups.held, groups.throttled_ns, groups.borrowed, per_group)


def shadow_row(totals: ShadowTotals | None, holder: str, surplus: int) -> dict[str, Any] | None:
    """A holder's shadow figures for the admin route (None: never shadowed)."""
    if totals is None:
        return None
    return {
        "held_tokens_total": totals.held.get(holder, 0),
        "throttled_seconds_total": totals.throttled_ns.get(holder, 0) / NS_PER_S,
        "borrowed_tokens_total": totals.borrowed.get(holder, 0),
        "residency_held": surplus,
    }


def _group_limits(settings: OutputRateSettings) -> Callable[[str], list[Any]]:
    """``limits_of`` for the groups' report rows (no residency cap of their own)."""

    def limits_of(group: str) -> list[Any]:
        if group not in settings.group_rates:  # removed by a reload
            return [None, None, None, 0]
        _rate, ceil, weight = settings.group_limit_of(group)
        return [ceil, weight, None, 0]

    return limits_of


class LimitsAudit:
    """The audit trail of the limits file: one record per reload (applied,
    unchanged or rejected), the last :data:`AUDIT_KEEP` kept for the admin
    route, and one structured log line per changed key.

    A record: ``time`` (UTC, ISO 8601), ``file``, ``outcome``
    (``started`` / ``applied`` / ``rejected``), ``digest`` (the hex SHA-256
    of the file version applied; for a rejected one, of the version still
    in force), ``previous_digest``, ``changes`` (``{key, from, to}`` per
    changed key; ``null`` for a key absent on that side) and, when
    rejected, ``reason``.  Keys are those of
    :func:`~vllm_output_rate.settings.limits_view`.
    """

    #: Wall clock for the records' time (s since the epoch); tests replace it.
    wall_clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, keep: int = AUDIT_KEEP) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=keep)
        self.file: str | None = None
        #: Hex SHA-256 of the file version in force (None: no file, or unknown).
        self.digest: str | None = None

    def entries(self) -> list[dict[str, Any]]:
        """The kept records, oldest first (copies: safe to serialise)."""
        return [dict(record) for record in self._records]

    def started(self, path: str, digest: str | None) -> None:
        self.file, self.digest = path, digest
        self._record("started", digest, [], log=logger.info)

    def applied(self, before: dict[str, Any], after: dict[str, Any], digest: str | None) -> None:
        changes = [
            {"key": key, "from": before.get(key), "to": after.get(key)}
            for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)
        ]
        previous = self.digest
        if digest is not None:
            self.digest = digest
        self._record("applied", self.digest, changes, previous=previous, log=logger.info)

    def rejected(self, reason: str) -> None:
        self._record("rejected", self.digest, [], previous=self.digest, reason=reason,
                     log=logger.error)

    def _record(
        self, outcome: str, digest: str | None, changes: list[dict[str, Any]],
        log: Callable[..., None], previous: str | None = None, reason: str | None = None,
    ) -> None:
        when = datetime.datetime.fromtimestamp(self.wall_clock(), datetime.timezone.utc)
        record: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "file": self.file,
            "outcome": outcome,
            "digest": digest,
            "previous_digest": previous,
            "changes": changes,
        }
        if reason is not None:
            record["reason"] = reason
        self._records.append(record)
        head = {k: v for k, v in record.items() if k != "changes"}
        # One line per changed key, each complete on its own (grep-able);
        # a reload that changed nothing, or failed, is one line too.
        for change in changes or [None]:
            line = dict(head, **({} if change is None else change))
            log("vllm-output-rate: limits audit %s", json.dumps(line, sort_keys=True, default=str))


def _borrowed_tokens(gate: Any) -> dict[str, int] | None:
    """Borrowed tokens per user; None while nobody may borrow."""
    borrowing = gate.borrowing
    return None if borrowing is None else borrowing.borrowed_tokens
