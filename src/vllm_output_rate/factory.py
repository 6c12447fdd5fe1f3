"""Build the limiter that the settings ask for.

The one place that knows every kind of limiter: it sits above the policy and
store layers so that neither has to import the other to choose.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_output_rate.policy.borrow import Borrowing, ShareTable
from vllm_output_rate.policy.displacement import Displacement
from vllm_output_rate.policy.drafts import DraftAccount
from vllm_output_rate.policy.eviction import EvictionBudget
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.groups import GroupCaps, GroupQuotas, GroupShareTable
from vllm_output_rate.policy.limiter import Limiter, OutputRateLimiter
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.policy.quota import ComposedLimiter, Level
from vllm_output_rate.policy.residency import Residency
from vllm_output_rate.policy.step import (
    EngineFacts,
    StepPolicy,
    generated_of,
    priority_of,
    tokens_held,
)
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.stores.backend import LeaseConfig
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.stores.redis_store import RedisLeaseBackend


def make_limiter(settings: OutputRateSettings, **kwargs: Any) -> Limiter:
    """The exact in-memory limiter without a store; with one, a leased limiter
    spending the quota shared through it (``kwargs`` go to its constructor)."""
    store = settings.store
    if store is None:
        return OutputRateLimiter(settings.default_rate, settings.user_rates, settings.burst_ns)
    backend = RedisLeaseBackend(store.url, prefix=store.prefix)
    config = LeaseConfig(fallback=store.fallback, expected_engines=store.expected_engines)
    return LeasedOutputRateLimiter(
        settings.default_rate, settings.user_rates, backend, config=config,
        burst_ns=settings.burst_ns, **kwargs
    )


#: Suffix of the ceiling quota's key prefix in a shared store: the ceiling of
#: a user lives under ``{prefix}:ceil:user:{<user>}``, apart from its rate.
CEILING_PREFIX_SUFFIX = ":ceil"
#: Suffix of the groups' key prefix in a shared store: a group's rate lives
#: under ``{prefix}:group:user:{<group>}``, its ceiling under
#: ``{prefix}:group:ceil:user:{<group>}``, apart from every user's keys.
GROUP_PREFIX_SUFFIX = ":group"


def _quota(
    settings: OutputRateSettings, default: float, rates: dict, suffix: str, **kwargs: Any
) -> Limiter:
    """A quota at these rates: in memory without a store; with one, shared
    through it under ``{prefix}{suffix}``."""
    store = settings.store
    if store is None:
        return OutputRateLimiter(default, rates, settings.burst_ns)
    backend = RedisLeaseBackend(store.url, prefix=store.prefix + suffix)
    config = LeaseConfig(fallback=store.fallback, expected_engines=store.expected_engines)
    return LeasedOutputRateLimiter(
        default, rates, backend, config=config, burst_ns=settings.burst_ns, **kwargs
    )


def make_ceiling_limiter(settings: OutputRateSettings, **kwargs: Any) -> Limiter:
    """The quota at each user's ``ceil`` (see :mod:`..policy.borrow`): in
    memory without a store; with one, shared through it like the rates, under
    keys of its own."""
    default, ceilings = settings.share_table().ceilings()
    return _quota(settings, default, ceilings, CEILING_PREFIX_SUFFIX, **kwargs)


def make_group_quotas(
    settings: OutputRateSettings, groups: GroupQuotas | None = None, **kwargs: Any
) -> GroupQuotas | None:
    """The groups' membership and quotas (:mod:`..policy.groups`); None
    without groups.  An existing ``groups`` (a reload) keeps its quotas'
    state, with the new rates, ceilings and members."""
    if not settings.group_rates:
        if groups is not None:
            groups.close()
        return None
    table = settings.group_table()
    members = {user: settings.user_groups.get(user) for user in settings.user_rates}
    # Every group is named: the default is never asked.
    default, rates = settings.default_rate, dict(settings.group_rates)
    if groups is None:
        rate = _quota(settings, default, rates, GROUP_PREFIX_SUFFIX, **kwargs)
        groups = GroupQuotas(members, settings.default_group, table, rate)
    else:
        groups.rate.update_rates(default, rates)
        groups.update(members, settings.default_group, table)
    if table.any_borrower():
        if groups.ceiling is None:
            groups.ceiling = _quota(
                settings, *table.ceilings(), GROUP_PREFIX_SUFFIX + CEILING_PREFIX_SUFFIX, **kwargs
            )
        else:
            groups.ceiling.update_rates(*table.ceilings())
    elif groups.ceiling is not None:
        groups.ceiling.close()
        groups.ceiling = None
    return groups


def make_borrowing(
    settings: OutputRateSettings,
    rate_limiter: Limiter,
    borrowing: Borrowing | None = None,
    groups: GroupQuotas | None = None,
) -> tuple[Borrowing | None, Limiter]:
    """Borrowing for ``settings`` and the limiter guaranteed tokens are paid
    from: (None, ``rate_limiter``) when nobody borrows and there are no
    groups, so hard caps run exactly as without the feature.  An existing
    ``borrowing`` (a reload) keeps its ceiling state and counters, with the
    new ceilings.  With ``groups`` every token is also paid on the user's
    group (:mod:`..policy.groups`)."""
    table = settings.share_table()
    users_borrow = table.any_borrower()
    ceiling = None if borrowing is None else borrowing.ceiling
    if users_borrow:
        if ceiling is None:
            ceiling = make_ceiling_limiter(settings)
        else:
            ceiling.update_rates(*table.ceilings())
    elif ceiling is not None:
        ceiling.close()
        ceiling = None
    levels = [Level(rate_limiter)]
    if ceiling is not None:  # a user with a ceiling above its rate pays it too
        levels.append(Level(ceiling, applies=table.ceiled))
    cap: GroupCaps | None = None
    if groups is None:
        shares: ShareTable | GroupShareTable = table
    else:
        shares = GroupShareTable(table, groups)
        levels += groups.levels()
        cap = GroupCaps(_own_cap_levels(table, rate_limiter, ceiling), groups)
    limiter = rate_limiter if len(levels) == 1 else ComposedLimiter(levels)
    if not shares.any_borrower():
        return None, limiter
    if borrowing is None:
        borrowing = Borrowing(shares, ceiling, cap)
    else:
        borrowing.update(shares, ceiling, cap)
    return borrowing, limiter


def _own_cap_levels(table: ShareTable, rate: Limiter, ceiling: Limiter | None) -> list[Level]:
    """The levels a user's borrowed token is paid on at its own level: its
    ceiling when it has one above its rate, its rate when it is a hard cap,
    none without a ceiling."""
    levels = [Level(rate, applies=lambda user: not table.borrows(user))]
    if ceiling is not None:
        levels.insert(0, Level(ceiling, applies=table.ceiled))
    return levels


def _residency_args(settings: OutputRateSettings) -> tuple:
    def limit_of(user: str) -> tuple[float, float | None]:
        rate, ceil, _weight = settings.limit_of(user)
        return rate, ceil

    return (
        settings.min_stream_tokens_per_second,
        settings.user_min_stream_tokens_per_second,
        limit_of,
    )


def make_residency(settings: OutputRateSettings) -> Residency:
    """Per-user residency caps (``policy/residency.py``): a hard-capped user's
    cap counts its rate, a borrower's its ceiling (none without a ceiling)."""
    return Residency(*_residency_args(settings))


def update_residency(residency: Residency, settings: OutputRateSettings) -> None:
    """The caps of ``settings`` (after a reload), in the same object."""
    residency.update(*_residency_args(settings))


def make_step_policy(
    settings: OutputRateSettings,
    limiter: Limiter,
    facts: EngineFacts,
    *,
    max_model_len: int,
    spec_decode: bool,
    can_release: Callable[[Any], bool],
    tokens_held: Callable[[Any], int] = tokens_held,
    generated_of: Callable[[Any], int] = generated_of,
    priority_of: Callable[[Any], int] = priority_of,
) -> StepPolicy:
    """One engine's step policy over ``limiter`` (the users' own rates), with
    every part the settings ask for (:func:`configure_step_policy`).

    ``max_model_len``: the recompute budget holds one longest request (none
    at ratio 0); ``spec_decode``: drafts are paid; the callables read what
    the policy needs of the engine's requests (``can_release``: may the
    request's KV be freed now; the others default to reading a
    :class:`~vllm_output_rate.policy.step.StepRequest`'s attributes)."""
    gate = StepGate(limiter)
    ratio = settings.recompute_budget
    budget = EvictionBudget(burst_tokens=max_model_len if ratio > 0 else 0, ratio=ratio)
    # Resident requests per user: as many as its quota keeps moving at the
    # minimum pace (the planner and Displacement read it too).
    residency = gate.lanes.residency = make_residency(settings)
    evicted: set[Any] = set()
    displacement = Displacement(
        gate.lanes,
        gate.ledger,
        budget,
        evicted,
        tokens_held=tokens_held,
        priority_of=priority_of if facts.priority_policy else None,
        can_release=can_release,
        residency=residency,
        generated_of=generated_of,
    )
    prompt_cost = gate.prompt_cost = PromptCost(gate.ledger, settings.input_token_weight)
    drafts = DraftAccount(gate.ledger) if spec_decode else None
    policy = StepPolicy(gate, facts, budget, residency, displacement, prompt_cost, drafts, evicted)
    configure_step_policy(policy, settings, limiter)
    return policy


def configure_step_policy(
    policy: StepPolicy, settings: OutputRateSettings, limiter: Limiter
) -> None:
    """Assemble the features ``settings`` ask for (at start, and on a reload
    between steps, after the rates were updated): groups, the composed quota
    every token is paid from (rate, ceiling, group: built here, once),
    borrowing, the prompt cost's weight and the residency caps.  Existing
    parts keep their state.  While nobody has a ceiling above its rate and no
    group is configured, the quota is the rate limiter itself and no
    borrowing runs: hard caps take their plain path."""
    groups = make_group_quotas(settings, policy.groups)
    borrowing, quota = make_borrowing(settings, limiter, policy.gate.borrowing, groups)
    policy.groups = groups
    policy.gate.borrowing = borrowing
    policy.ledger.limiter = quota  # its one holder (the gate and drafts read it there)
    prompt_cost = policy.prompt_cost
    prompt_cost.set_weight(settings.input_token_weight)
    prompt_cost.group_of = None if groups is None else groups.of
    update_residency(policy.residency, settings)
