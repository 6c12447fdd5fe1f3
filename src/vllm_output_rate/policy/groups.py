"""Groups: a second quota over users (a team, a tenant).

Optional, present only when groups are configured; plain Python, no vLLM.
A group has a limit written as a user's (``{rate, ceil, weight}``), and a user
joins at most one group (``group:`` in its own limit).  A user without a
group is decided exactly as without groups.

**The rule.**  Every token charged to a user of a group (output, drafts,
prompt cost) is paid on the user's quotas *and* on the group's, and a token
goes only when both levels can pay:

* a *guaranteed* token needs the user's guaranteed quota (its rate, and its
  ceiling when it has one above the rate) and the group's (likewise): the
  factory composes the levels (:class:`~.quota.ComposedLimiter`), which pays
  them all, all or nothing per token;
* a *borrowed* token (spare capacity, :mod:`.borrow`) needs each level's
  *cap*: its ceiling when it has one above its rate, its rate when it is a
  hard cap, nothing without a ceiling (:class:`GroupCaps`).  So a user may
  borrow when either level may (a hard-capped user of a group with a ceiling
  spends its own rate beyond the group's rate, up to the group's ceiling),
  and every level's ceiling bounds every token of it.

**Bound.**  Every token of a group's users is a take on the group's quota at
its cap, so over any window of W seconds the group's users together get at
most ``(W + burst) x cap + 1`` tokens (the GCRA bound of that quota; cap = the
group's rate for a hard-capped group, and, with borrowing, the group's ceiling
for all of its tokens and its rate for the guaranteed ones), each user still
within its own bounds.  Prompt cost adds its one chunk of debt per user, and
drafts their tokens in flight, exactly as for a user.

**Fair share.**  Spare capacity is shared in two levels (:mod:`.borrow`):
first between groups and users without a group, by their weights, then
inside a group between its members, by theirs.

One level is enough: a group is what operators budget (a team, a tenant, a
customer), and the scheduler's unit of fairness stays the user.  Every level
costs each charge one more quota to pay (a take on the group's limiter; with
a store, one more key and lease per charge), and with two levels a token
already needs two to agree at every step; a tree would need every level's
ceiling to agree before a token goes, with more ways for a user to be held
back by a quota it cannot see.  Nested budgets are better expressed as one
group per budget holder.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from vllm_output_rate.policy.borrow import ShareTable
from vllm_output_rate.policy.limiter import Limiter
from vllm_output_rate.policy.quota import ComposedLimiter, Level


def _cap(table: ShareTable, key: str, rate: Limiter, ceiling: Limiter | None) -> Limiter | None:
    """The quota ``key``'s borrowed tokens are paid on: its ceiling when it
    has one above its rate, its rate when it is a hard cap, none when it has
    no ceiling."""
    if table.ceiled(key):
        return ceiling
    return None if table.borrows(key) else rate


class GroupQuotas:
    """Who is in which group, each group's shares, and the groups' quotas.

    ``rate`` is keyed by group and holds each group's rate; ``ceiling``
    (None while no group has a ceiling above its rate) each group's ceiling.
    The owner of the quotas (the scheduler) keeps this object across
    reloads, so the groups' quota state is kept too.
    """

    def __init__(
        self,
        user_groups: Mapping[str, str | None],
        default_group: str | None,
        table: ShareTable,
        rate: Limiter,
        ceiling: Limiter | None = None,
    ) -> None:
        self.rate = rate
        self.ceiling = ceiling
        self.update(user_groups, default_group, table)

    def update(
        self, user_groups: Mapping[str, str | None], default_group: str | None, table: ShareTable
    ) -> None:
        """New membership and shares (a reload); the quotas keep their state.

        ``user_groups`` names every user with an entry of its own (None: in
        no group); every other user is in ``default_group``.
        """
        self._of = dict(user_groups)
        self.default_group = default_group
        self.table = table

    def of(self, user: str) -> str | None:
        """``user``'s group, or None."""
        return self._of.get(user, self.default_group)

    def members(self) -> dict[str, list[str]]:
        """group -> the named users in it (the default group's unnamed users aside)."""
        out: dict[str, list[str]] = {}
        for user, group in self._of.items():
            if group is not None:
                out.setdefault(group, []).append(user)
        return out

    def guaranteed(self) -> Limiter:
        """The groups' guaranteed quota, keyed by group: rate, and ceiling for
        a group with one."""
        if self.ceiling is None:
            return self.rate
        return ComposedLimiter(self.levels(_group))

    def levels(self, key_of: Callable[[str], str | None] | None = None) -> list[Level]:
        """The levels of the groups' guaranteed quota, paid by each user under
        its group (``key_of``: another mapping to groups)."""
        key_of = self.of if key_of is None else key_of
        levels = [Level(self.rate, key_of)]
        if self.ceiling is not None:
            levels.append(Level(self.ceiling, key_of, self._ceiled))
        return levels

    def cap_levels(self) -> list[Level]:
        """The levels a borrowed token of a user is paid on at its group: the
        group's ceiling when it has one above its rate, its rate when it is a
        hard cap, none without a ceiling."""
        levels = [Level(self.rate, self.of, self._hard_capped)]
        if self.ceiling is not None:
            levels.insert(0, Level(self.ceiling, self.of, self._ceiled))
        return levels

    def _ceiled(self, group: str) -> bool:
        return self.table.ceiled(group)

    def _hard_capped(self, group: str) -> bool:
        return not self.table.borrows(group)

    def cap(self, group: str) -> Limiter | None:
        """The quota a borrowed token of ``group`` is paid on (None: none)."""
        return _cap(self.table, group, self.rate, self.ceiling)

    def close(self) -> None:
        self.rate.close()
        if self.ceiling is not None:
            self.ceiling.close()


class GroupShareTable:
    """The users' :class:`~.borrow.ShareTable` seen through their groups: what
    :class:`~.borrow.Borrowing` asks of a table.

    A user *borrows* when its own limit or its group's has room above the
    rate; it is *ceiled* (its borrowed tokens are paid on a quota,
    :class:`GroupCaps`) unless neither level has a ceiling.  A user without a
    group is the users' table's alone.
    """

    def __init__(self, users: ShareTable, groups: GroupQuotas) -> None:
        self.users = users
        self.groups = groups
        self.group_of = groups.of

    def borrows(self, user: str) -> bool:
        if self.users.borrows(user):
            return True
        group = self.group_of(user)
        return group is not None and self.groups.table.borrows(group)

    def ceiled(self, user: str) -> bool:
        group = self.group_of(user)
        if group is None:
            return self.users.ceiled(user)
        users = self.users
        if users.ceiled(user) or not users.borrows(user):
            return True
        return self.groups.cap(group) is not None

    def weight(self, user: str) -> float:
        return self.users.weight(user)

    def group_weight(self, group: str) -> float:
        return self.groups.table.weight(group)

    def ceilings(self) -> tuple[float, dict[str, float]]:
        return self.users.ceilings()

    def any_borrower(self) -> bool:
        return self.users.any_borrower() or self.groups.table.any_borrower()


class GroupCaps(ComposedLimiter):
    """The quota borrowed tokens are paid on, per user, at both levels: what
    :class:`~.borrow.Borrowing` needs of its cap.

    A composition of the user's own cap levels ``own`` (its ceiling when it
    has one above its rate, its rate when it is a hard cap) and its group's
    (:meth:`GroupQuotas.cap_levels`): a token is taken only when all of them
    can pay, from all of them.  Borrowing also asks each level alone, since
    a group's cap is shared by its members within a step.
    """

    def __init__(self, own: Sequence[Level], groups: GroupQuotas) -> None:
        super().__init__([*own, *groups.cap_levels()])
        self._own = ComposedLimiter(own)
        self.groups = groups

    def own_available(self, user: str, now_ns: int) -> int:
        """Tokens the user's own cap could pay for now, its group's aside."""
        return self._own.available(user, now_ns)

    def group_available(self, group: str, now_ns: int) -> int | None:
        """Tokens ``group``'s own cap could pay for now, shared by its members
        (None: the group has no cap)."""
        cap = self.groups.cap(group)
        return None if cap is None else cap.available(group, now_ns)


def _group(group: str) -> str:
    return group
