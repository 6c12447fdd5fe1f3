"""Shadow mode: what the policy would have done, counted beside stock vLLM.

In shadow mode stock vLLM schedules every step; the scheduler hands this
module, per step, how many output tokens each user was given (its requests
that reached their sampling position), and :class:`ShadowCounter` runs the
same quotas on the side, on GCRAs of their own (:mod:`.limiter`), that
never decide anything:

* **held** -- tokens a quota could not pay when they were sampled: the
  tokens enforcement would have held back.  A token the quota refuses is
  not charged (it was held, not spent), so a user sampling at twice its
  rate shows half of its tokens held, as a GCRA policing that stream would.
* **borrowed** -- for a user whose ceiling is above its rate (or who has
  none): tokens beyond its rate that its ceiling paid.  Every token is
  offered to the ceiling first (as enforcement pays a guaranteed token on
  both), then to the rate; what the ceiling refuses is held.
* **throttled seconds** -- a step in which some of a holder's tokens were
  held counts, as enforcement counts a blocked step, the time until the
  next step; but at most the time the holder's quota needs to pay what was
  held in it (its top rate: the ceiling when it has one), so an engine that
  goes quiet after such a step does not count its idle time.

Groups are a second level: the tokens a group's members' own quotas paid
(guaranteed or borrowed) are offered to the group's quotas in the same way;
a group's row counts what its quotas would have held, borrowed and
throttled.  A user's row counts its own quotas only: enforcement would
have held the sum of both.

Each figure is cumulative per holder and only grows, except that
:meth:`ShadowCounter.forget` drops idle users (their figures restart from
0; the report's owner tells its monitor).  ``sampled`` counts every output
token given, for the users' charged-token series while shadowing.

Plain Python, no vLLM.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from vllm_output_rate.policy.borrow import ShareTable
from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.policy.limiter import OutputRateLimiter

#: Steps between sweeps of idle holders out of the shadow GCRAs.
CLEANUP_EVERY_STEPS = 1000


class ShadowAccount:
    """One level of holders (users, or groups): a rate quota, a ceiling
    quota and what they would have held, borrowed and throttled.

    ``table`` gives each holder's rate, ceiling and whether it borrows.
    """

    def __init__(self, table: ShareTable, rates: tuple[float, Mapping[str, float]], burst_ns: int) -> None:
        self.table = table
        self.rate = OutputRateLimiter(*rates, burst_ns=burst_ns)
        self.ceiling = OutputRateLimiter(*table.ceilings(), burst_ns=burst_ns)
        #: holder -> cumulative tokens held / borrowed, ns throttled.
        self.held: dict[str, int] = {}
        self.borrowed: dict[str, int] = {}
        self.throttled_ns: dict[str, int] = {}
        #: holder -> ns its last step's held tokens may count as throttled.
        self._blocked: dict[str, int] = {}

    def configure(self, table: ShareTable, rates: tuple[float, Mapping[str, float]]) -> None:
        """New limits (a reload): every holder keeps its quotas' state."""
        self.table = table
        self.rate.update_rates(*rates)
        self.ceiling.update_rates(*table.ceilings())

    def close_step(self, elapsed_ns: int) -> None:
        """The step after a step with held tokens began ``elapsed_ns`` later."""
        throttled = self.throttled_ns
        for holder, most in self._blocked.items():
            throttled[holder] = throttled.get(holder, 0) + min(elapsed_ns, most)
        self._blocked.clear()

    def pay(self, holder: str, now_ns: int, tokens: int) -> int:
        """Offer ``tokens`` of ``holder`` sampled at ``now_ns``; return how
        many its quotas paid (guaranteed or borrowed), count the rest held."""
        table = self.table
        if table.ceiled(holder):
            paid = self.ceiling.take_up_to(holder, now_ns, tokens)
        elif table.borrows(holder):
            paid = tokens  # no ceiling: only the engine's room bounds it
        else:
            paid = self.rate.take_up_to(holder, now_ns, tokens)
            self._hold(holder, tokens - paid, self.rate.rate_of(holder))
            return paid
        guaranteed = self.rate.take_up_to(holder, now_ns, paid)
        if paid > guaranteed:
            self.borrowed[holder] = self.borrowed.get(holder, 0) + paid - guaranteed
        self._hold(holder, tokens - paid, self.ceiling.rate_of(holder))
        return paid

    def _hold(self, holder: str, held: int, top_rate: float) -> None:
        if held <= 0:
            return
        self.held[holder] = self.held.get(holder, 0) + held
        self._blocked[holder] = int(held * NS_PER_S / top_rate)

    def cleanup(self, now_ns: int) -> None:
        self.rate.cleanup_idle_users(now_ns)
        self.ceiling.cleanup_idle_users(now_ns)

    def forget(self, holders: Iterable[str]) -> None:
        for holder in holders:
            for totals in (self.held, self.borrowed, self.throttled_ns):
                totals.pop(holder, None)


class ShadowCounter:
    """The policy's quotas run beside stock vLLM's decisions (see the module doc).

    ``users``: every user's rate, ceiling and weight; ``groups`` (None:
    none) the groups' as a table whose named entries are the groups, with
    ``group_of`` naming each user's group.
    """

    def __init__(
        self,
        users: ShareTable,
        user_rates: tuple[float, Mapping[str, float]],
        groups: ShareTable | None = None,
        group_rates: tuple[float, Mapping[str, float]] | None = None,
        group_of: Callable[[str], str | None] | None = None,
        burst_ns: int = DEFAULT_BURST_NS,
    ) -> None:
        self._burst_ns = burst_ns
        self.users = ShadowAccount(users, user_rates, burst_ns)
        self.groups: ShadowAccount | None = None
        self._group_of: Callable[[str], str | None] | None = None
        #: user -> cumulative output tokens given while shadowing.
        self.sampled: dict[str, int] = {}
        self._last_ns: int | None = None
        self._steps = 0
        self.configure(users, user_rates, groups, group_rates, group_of)

    def configure(
        self,
        users: ShareTable,
        user_rates: tuple[float, Mapping[str, float]],
        groups: ShareTable | None = None,
        group_rates: tuple[float, Mapping[str, float]] | None = None,
        group_of: Callable[[str], str | None] | None = None,
    ) -> None:
        """New limits (a reload); the quotas and totals keep their state.
        A group level, once created, keeps its totals when groups go away."""
        self.users.configure(users, user_rates)
        if groups is None or group_rates is None or group_of is None:
            self._group_of = None
            return
        if self.groups is None:
            self.groups = ShadowAccount(groups, group_rates, self._burst_ns)
        else:
            self.groups.configure(groups, group_rates)
        self._group_of = group_of

    def observe(self, now_ns: int, sampled: Mapping[str, int]) -> None:
        """One stock step at ``now_ns`` gave each user ``sampled[user]`` tokens."""
        last = self._last_ns
        self._last_ns = now_ns
        group_level = self.groups
        if last is not None:
            self.users.close_step(now_ns - last)
            if group_level is not None:
                group_level.close_step(now_ns - last)
        self._steps += 1
        if self._steps % CLEANUP_EVERY_STEPS == 0:
            self.users.cleanup(now_ns)
            if group_level is not None:
                group_level.cleanup(now_ns)
        self.observe_extra(now_ns, sampled)

    def observe_extra(self, now_ns: int, sampled: Mapping[str, int]) -> None:
        """More tokens given at ``now_ns`` within the current step (drafts
        the model accepted, known when the step's output arrives)."""
        group_level = self.groups
        group_of = self._group_of
        per_group: dict[str, int] = {}
        totals = self.sampled
        for user, tokens in sampled.items():
            if tokens <= 0:
                continue
            totals[user] = totals.get(user, 0) + tokens
            paid = self.users.pay(user, now_ns, tokens)
            if group_of is not None and paid:
                group = group_of(user)
                if group is not None:
                    per_group[group] = per_group.get(group, 0) + paid
        if group_level is not None:
            for group, tokens in per_group.items():
                group_level.pay(group, now_ns, tokens)

    def forget(self, users: Iterable[str]) -> None:
        """Drop idle users' totals (they restart from 0 if seen again)."""
        users = list(users)
        self.users.forget(users)
        for user in users:
            self.sampled.pop(user, None)


def residency_surplus(
    resident: Mapping[str, int], cap_of: Callable[[str], int | None]
) -> dict[str, int]:
    """user -> resident requests beyond its residency cap (users with any):
    what the cap would have kept waiting."""
    out: dict[str, int] = {}
    for user, count in resident.items():
        cap = cap_of(user)
        if cap is not None and count > cap:
            out[user] = count - cap
    return out
