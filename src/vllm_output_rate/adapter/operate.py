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
import logging
import threading
import time
from typing import Any, Callable

from vllm_output_rate.policy.monitor import OTHER_USERS, ChargeHistory, GroupTotals, UserMonitor
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.settings import (
    CONFIG_KEY,
    INPUT_TOKEN_WEIGHT_KEY,
    MIN_PACE_KEY,
    OutputRateConfigError,
    OutputRateSettings,
    file_signature,
    load_limits_file,
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
    ) -> None:
        self.path = path
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
            settings = load_limits_file(self.path, self.input_token_weight, self.min_pace)
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


class OperateSchedulerMixin:
    """Reload, stats and admin snapshot; list it before ``OutputRateSchedulerMixin``."""

    #: Wall-free monotonic clock for reports (ns); tests replace it.
    output_rate_operate_clock: Callable[[], int] = staticmethod(time.monotonic_ns)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings: OutputRateSettings = self.output_rate_settings
        self.output_rate_reloads = 0
        self.output_rate_reload_failures = 0
        self._operate = operate = OperateState(settings.metrics_max_users)
        if settings.limits_file:
            section = self.vllm_config.additional_config[CONFIG_KEY]
            operate.watcher = LimitsFileWatcher(
                settings.limits_file, self._limits_changed, self._limits_rejected,
                input_token_weight=section.get(INPUT_TOKEN_WEIGHT_KEY, 0.0),
                min_pace=section.get(MIN_PACE_KEY, DEFAULT_MIN_STREAM_TOKENS_PER_SECOND),
            )
            operate.watcher.start()

    # -- reload ----------------------------------------------------------------

    def _limits_changed(self, new: OutputRateSettings) -> None:
        # Called on the watcher thread: only hand over; the engine thread applies.
        self._operate.pending = new

    def _limits_rejected(self, reason: str) -> None:
        self.output_rate_reload_failures += 1
        logger.error("vllm-output-rate: limits file rejected, old limits stay in force: %s", reason)

    def apply_output_rate_limits(self, new: OutputRateSettings) -> None:
        """Switch to ``new`` rates now (engine thread, between steps)."""
        changed = self.output_rate_limiter.update_rates(new.default_rate, new.user_rates)
        settings = dataclasses.replace(
            self.output_rate_settings, default_rate=new.default_rate, user_rates=dict(new.user_rates),
            input_token_weight=new.input_token_weight,
            default_share=new.default_share, user_shares=dict(new.user_shares),
            group_rates=dict(new.group_rates), group_shares=dict(new.group_shares),
            user_groups=dict(new.user_groups), default_group=new.default_group,
            min_stream_tokens_per_second=new.min_stream_tokens_per_second,
            user_min_stream_tokens_per_second=dict(new.user_min_stream_tokens_per_second),
        )
        # Caps follow the new limits (streams now beyond them give way first),
        # and so do ceilings, groups and the prompt cost's weight.
        self.configure(settings)
        self.output_rate_reloads += 1
        logger.info(
            "vllm-output-rate: limits reloaded (default %s tok/s, %d override(s), %d group(s), "
            "input token weight %s; %d active user(s) changed rate)",
            new.default_rate, len(new.user_rates), len(new.group_rates), new.input_token_weight,
            len(changed),
        )

    def schedule(self, *args: Any, **kwargs: Any):
        operate = self._operate
        pending = operate.pending
        if pending is not None:
            operate.pending = None
            self.apply_output_rate_limits(pending)
        now = self.output_rate_operate_clock()
        if now >= operate.next_tick:
            operate.next_tick = now + REPORT_PERIOD_NS
            operate.history.record(now, self._output_rate_charged())
        return super().schedule(*args, **kwargs)

    def shutdown(self) -> None:
        if self._operate.watcher is not None:
            self._operate.watcher.stop()
        super().shutdown()

    # -- stats -------------------------------------------------------------------

    def make_stats(self, *args: Any, **kwargs: Any):
        stats = super().make_stats(*args, **kwargs)
        if stats is None:
            return None
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

    def _output_rate_eviction_totals(self) -> dict[str, int]:
        budget = getattr(self, "output_rate_eviction_budget", None)
        if budget is None:
            return {}
        return {
            "evictions_total": budget.evictions,
            "eviction_recompute_tokens_total": budget.spent_tokens,
        }

    def _output_rate_charged(self) -> dict[str, int]:
        return self.output_rate_gate.ledger.charged_tokens

    def output_rate_counts(self) -> dict[str, tuple[int, int, int]]:
        """user -> (active, throttled, waiting) requests now."""
        gate = self.output_rate_gate
        counts: dict[str, list[int]] = {}
        if self.running:  # else the last step's users have all left
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
                **self._output_rate_eviction_totals(),
                "reloads_total": self.output_rate_reloads,
                "reload_failures_total": self.output_rate_reload_failures,
                # Shared-store mode and totals (only with --output-rate-store).
                **self.output_rate_limiter.figures(),
            },
        )
        self._operate.group_reports.add_to(report, self, now_ns, counts)
        # Users idle for a while are forgotten, so the per-user totals (and
        # this step's work) stay bounded by the users active recently, not by
        # every name ever seen.  Their reported counters are unaffected.
        forgotten = monitor.idle_users(now_ns, FORGET_IDLE_S)
        if forgotten:
            prompt_totals = self.output_rate_prompt_cost.prompt_tokens
            borrowed = _borrowed_tokens(self.output_rate_gate) or {}
            for totals in (ledger.charged_tokens, ledger.throttled_ns, prompt_totals, borrowed):
                for user in forgotten:
                    totals.pop(user, None)
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
            }
            store = limiter.figures(user)
            if store:  # with a shared store: this engine's lease totals for the user
                rows[user]["store"] = store
        if groups is not None:
            for user, row in rows.items():
                row["group"] = groups.of(user)
        return {
            "groups": self._operate.group_reports.admin_rows(self, rows, recent, limiter_now),
            "default_rate": settings.default_rate,
            "input_token_weight": settings.input_token_weight,
            "default_ceil": settings.default_limit()[1],
            "default_weight": settings.default_limit()[2],
            "limits_file": settings.limits_file,
            "reloads": self.output_rate_reloads,
            "reload_failures": self.output_rate_reload_failures,
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
        #: Settings the watcher validated, applied before the next step.
        self.pending: OutputRateSettings | None = None
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
        totals.update("charged", engine.output_rate_gate.ledger.charged_tokens, group_of)
        totals.update("prompt", engine.output_rate_prompt_cost.prompt_tokens, group_of)
        totals.update("borrowed", _borrowed_tokens(engine.output_rate_gate) or {}, group_of)
        return totals.totals

    def add_to(self, report: dict, engine: Any, now_ns: int, counts: dict) -> None:
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
        )
        rows["users"].pop(OTHER_USERS, None)  # every group is a configured one
        report["groups"] = rows["users"]
        report["groups_removed"] = rows["removed"]
        report["user_groups"] = {
            user: group for user in report["users"] if (group := group_of(user)) is not None
        }

    def admin_rows(self, engine: Any, user_rows: dict, recent: dict, now_ns: int) -> dict:
        """Per-group state for the admin route ({} without groups)."""
        groups = getattr(engine, "output_rate_groups", None)
        if groups is None:
            return {}
        settings = engine.output_rate_settings
        totals = self.totals_now(engine)
        members = groups.members()
        quota = groups.guaranteed()
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
        return rows


def _no_group(user: str) -> None:
    return None


def _borrowed_tokens(gate: Any) -> dict[str, int] | None:
    """Borrowed tokens per user; None while nobody may borrow."""
    borrowing = gate.borrowing
    return None if borrowing is None else borrowing.borrowed_tokens
