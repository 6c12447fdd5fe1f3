"""Configuration of per-user output rates, and its validation.

The single source of truth is a plain dict stored under
``additional_config["output_rate"]`` of vLLM's config, because that dict
travels unchanged from the API process to the engine-core process and is also
what the offline ``LLM(..., additional_config=...)`` API accepts::

    {"default_user_output_tokens_per_second": 100,
     "user_output_tokens_per_second": {"user-a": 20}}

The two ``vllm serve`` flags are parsed into exactly this dict.  Every problem
is reported as :class:`OutputRateConfigError` with a one-line message naming
the flag (or key) and what is wrong with it.  No vLLM import here.

Ranges.  A rate, a ceiling and a borrowing weight (of a user, the default or
a group) lie in [``MIN_RATE``, ``MAX_RATE``] = [1e-6, 1e9]:

* ``MAX_RATE`` = 1e9 tok/s is one token per nanosecond, the shared store's
  unit: it keeps ``1 / rate`` in whole ns rounded up, so a faster rate is
  granted at 1e9 tok/s anyway, and a lease (0.1 s of the rate) stays far
  inside the store's integers (rates near 1e308 overflowed them);
* ``MIN_RATE`` = 1e-6 tok/s is one token per 11.6 days: ``1 / rate`` is then
  1e15 ns, below 2**53, where the store's Lua doubles are still exact;
* a weight defaults to the rate, so it has the same range; borrowing
  counters (tokens borrowed / weight) stay finite (a weight near 1e-300 made
  them infinite).

``input_token_weight`` and ``recompute_budget`` (tokens per token) lie in
[0, ``MAX_RATIO``] = [0, 1e6]: a prompt token costing more than a million
output tokens, or a million recomputed tokens per scheduled request (the
eviction budget's cap is the model's context length), has no use, and an
unbounded JSON integer would not even convert to a float.

Names.  A user or group may not be called ``OTHER_USERS`` (``__other__``):
that is the metrics' row summing the users without a series of their own.

Groups.  A user with an entry of its own is in the group its entry names
(``"group": null``: in none); an entry without the key ``group`` (a plain
number included) keeps the default's group, so giving a user of the
default group its own rate does not move it out of the group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from vllm_output_rate.policy.borrow import Share, ShareTable
from vllm_output_rate.policy.eviction import DEFAULT_RECOMPUTE_RATIO
from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.policy.monitor import OTHER_USERS
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.stores.config import StoreSettings, parse_store_section

CONFIG_KEY = "output_rate"
DEFAULT_KEY = "default_user_output_tokens_per_second"
OVERRIDES_KEY = "user_output_tokens_per_second"
DEFAULT_FLAG = "--default-user-output-tokens-per-second"
OVERRIDES_FLAG = "--user-output-tokens-per-second"

#: Identity key inside ``SamplingParams.extra_args`` (``vllm_xargs`` on the wire).
USER_ARG = "output_rate_user"
#: The shared quota of requests that carry no identity.
ANONYMOUS_USER = "__anonymous__"
#: Longest accepted identity, in characters.
MAX_USER_LEN = 256

#: ``additional_config["output_rate"]`` keys for the operating features.
LIMITS_FILE_KEY = "limits_file"
METRICS_MAX_USERS_KEY = "metrics_max_users"
LIMITS_FILE_FLAG = "--output-rate-limits-file"
METRICS_MAX_USERS_FLAG = "--output-rate-metrics-max-users"
#: Per-user metric series beyond the configured users (the rest: ``__other__``).
DEFAULT_METRICS_MAX_USERS = 100
#: Shared quota store (``vllm_output_rate.stores.config``): {"url", "fallback", ...}.
STORE_KEY = "store"
#: Recomputed tokens per request scheduled in a step that evictions for waiting requests may
#: cost (``vllm_output_rate.policy.eviction``).
RECOMPUTE_BUDGET_KEY = "recompute_budget"
RECOMPUTE_BUDGET_FLAG = "--output-rate-recompute-budget"
#: Tokens of quota each computed prompt token costs (0: prompt tokens are free).
INPUT_TOKEN_WEIGHT_KEY = "input_token_weight"
INPUT_TOKEN_WEIGHT_FLAG = "--output-rate-input-token-weight"
#: Groups of users: ``{group: limit}``, each limit as a user's; a user joins
#: one with the key ``group`` of its own limit (see ``policy/groups.py``).
GROUPS_KEY = "groups"
GROUPS_FLAG = "--output-rate-groups"
GROUP_KEY = "group"
#: Minimum pace of one resident stream (tok/s): a user's requests become
#: resident only as far as its quota keeps each moving at this pace
#: (``policy/residency.py``).  Top-level: everybody's default (also a limits
#: file key, reloaded); in a user's ``{rate, ...}``: that user's own; 0: off.
MIN_PACE_KEY = "min_stream_tokens_per_second"
MIN_PACE_FLAG = "--output-rate-min-stream-tokens-per-second"
#: Whether the policy decides (``enforce``) or only counts beside stock
#: vLLM's decisions (``shadow``); also a limits-file key, so a reload
#: switches between them.
MODE_KEY = "mode"
MODE_FLAG = "--output-rate-mode"
#: How far a quota may run ahead of its rate, in seconds: in any W seconds a user
#: gets at most (W + burst) x N + 1 tokens, and one step takes at most burst x N + 1
#: of them, so a step longer than the burst costs a backlogged capped user
#: (step - burst) x N of its limit.  Set at least the engine's longest step.
#: Startup only (not a limits-file key): every quota's bound is stated on it.
BURST_KEY = "burst_seconds"
BURST_FLAG = "--output-rate-burst-seconds"
DEFAULT_BURST_SECONDS = DEFAULT_BURST_NS / NS_PER_S
#: Burst range (s): below a millisecond no step fits; above a minute the
#: "paced evenly" promise means little.
MIN_BURST_SECONDS = 0.001
MAX_BURST_SECONDS = 60.0
ENFORCE = "enforce"
SHADOW = "shadow"
MODES = (ENFORCE, SHADOW)
#: Range of every rate, ceiling and weight (tok/s; see the module docstring).
MIN_RATE = 1e-6
MAX_RATE = 1e9
#: Largest ``input_token_weight`` and ``recompute_budget`` (tokens per token).
MAX_RATIO = 1e6
#: Names no user or group may take (the metrics' catch-all row).
RESERVED_NAMES = frozenset({OTHER_USERS})
_SECTION_KEYS = {
    DEFAULT_KEY, OVERRIDES_KEY, LIMITS_FILE_KEY, METRICS_MAX_USERS_KEY, STORE_KEY,
    RECOMPUTE_BUDGET_KEY, INPUT_TOKEN_WEIGHT_KEY, GROUPS_KEY, MIN_PACE_KEY, MODE_KEY, BURST_KEY,
}
#: The keys a limits file may hold.
LIMITS_FILE_KEYS = (
    DEFAULT_KEY, OVERRIDES_KEY, GROUPS_KEY, INPUT_TOKEN_WEIGHT_KEY, MIN_PACE_KEY, MODE_KEY,
)


class OutputRateConfigError(ValueError):
    """A rate-limit setting is invalid; the message names the setting."""


class InvalidUserError(ValueError):
    """A request's ``output_rate_user`` value is not a usable identity."""


@dataclass(frozen=True)
class OutputRateSettings:
    """Validated per-user output rates (tokens per second).

    ``limits_file``: when set, the rates were read from this file (it wins
    over the flags) and the engine re-reads it when it changes.
    ``metrics_max_users``: per-user metric series for users without a
    configured rate (the others are summed under ``__other__``).
    ``recompute_budget``: recomputed tokens per request scheduled that evicting
    throttled requests for waiting ones may cost (0: never).
    ``input_token_weight``: tokens of quota each computed prompt token costs
    (0: prompt tokens are free; see ``policy/prompt_cost.py``).
    ``group_rates`` / ``group_shares``: each group's limit, as a user's;
    ``user_groups``: the group of each named user that has one (resolved:
    an entry without the key ``group`` is in ``default_group``, an entry
    with ``"group": null`` in none);
    ``default_group``: the group of every user without an entry (None: none).
    ``min_stream_tokens_per_second`` / ``user_min_stream_tokens_per_second``:
    the minimum pace per resident stream, everybody's and per user (0: no
    residency cap; see ``policy/residency.py``).
    ``mode``: ``enforce`` (the policy decides) or ``shadow`` (stock vLLM
    decides; the policy only counts what it would have done).
    ``burst_seconds``: how far every quota (rates, ceilings, groups) may run
    ahead of its rate; the bound is (W + burst) x N + 1 tokens in W seconds.
    """

    default_rate: float
    user_rates: Mapping[str, float] = field(default_factory=dict)
    limits_file: str | None = None
    metrics_max_users: int = DEFAULT_METRICS_MAX_USERS
    store: StoreSettings | None = None  # shared quota store; None: in-memory
    recompute_budget: float = DEFAULT_RECOMPUTE_RATIO
    input_token_weight: float = 0.0
    default_share: Share | None = None
    user_shares: Mapping[str, Share] = field(default_factory=dict)
    group_rates: Mapping[str, float] = field(default_factory=dict)
    group_shares: Mapping[str, Share] = field(default_factory=dict)
    user_groups: Mapping[str, str] = field(default_factory=dict)
    default_group: str | None = None
    min_stream_tokens_per_second: float = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
    user_min_stream_tokens_per_second: Mapping[str, float] = field(default_factory=dict)
    mode: str = ENFORCE
    burst_seconds: float = DEFAULT_BURST_SECONDS
    #: Hex SHA-256 of the limits file version these settings were read from.
    limits_digest: str | None = None

    def inert_weights(self) -> list[str]:
        """The limits that set a weight but no ceiling above their rate, as
        ``"user 'c' (weight 3)"``: they never borrow, so the weight does
        nothing (an operator who wrote ``{rate: 5, weight: 3}`` likely meant
        ``ceil: null``).  A weight equal to the rate is its default: not listed."""
        found = []
        limits = [("the default", self.default_rate, self.default_share)]
        limits += [(f"user {user!r}", self.user_rates[user], share) for user, share in self.user_shares.items()]
        limits += [(f"group {group!r}", self.group_rates[group], share) for group, share in self.group_shares.items()]
        for name, rate, share in limits:
            if share is None or share.ceil is None or share.ceil > rate or share.weight == rate:
                continue
            found.append(f"{name} (weight {share.weight:g})")
        return found

    def to_config(self) -> dict[str, Any]:
        """The ``additional_config["output_rate"]`` form of these settings."""
        config: dict[str, Any] = {
            DEFAULT_KEY: _limit_value(
                self.default_rate, self.default_share, self.default_group,
                group_key=self.default_group is not None,
            ),
            OVERRIDES_KEY: {user: self._user_value(user) for user in self.user_rates},
        }
        if self.group_rates:
            config[GROUPS_KEY] = {
                group: _limit_value(rate, self.group_shares.get(group))
                for group, rate in self.group_rates.items()
            }
        if self.limits_file is not None:
            config[LIMITS_FILE_KEY] = self.limits_file
        if self.metrics_max_users != DEFAULT_METRICS_MAX_USERS:
            config[METRICS_MAX_USERS_KEY] = self.metrics_max_users
        if self.store is not None:
            config[STORE_KEY] = self.store.to_config()
        if self.recompute_budget != DEFAULT_RECOMPUTE_RATIO:
            config[RECOMPUTE_BUDGET_KEY] = self.recompute_budget
        if self.input_token_weight:
            config[INPUT_TOKEN_WEIGHT_KEY] = self.input_token_weight
        if self.min_stream_tokens_per_second != DEFAULT_MIN_STREAM_TOKENS_PER_SECOND:
            config[MIN_PACE_KEY] = self.min_stream_tokens_per_second
        if self.mode != ENFORCE:
            config[MODE_KEY] = self.mode
        if self.burst_seconds != DEFAULT_BURST_SECONDS:
            config[BURST_KEY] = self.burst_seconds
        return config

    @property
    def burst_ns(self) -> int:
        """``burst_seconds`` in whole nanoseconds, as the quotas take it."""
        return round(self.burst_seconds * NS_PER_S)

    def _user_value(self, user: str) -> Any:
        """``user``'s entry as written: the key ``group`` only where its group
        is not the default's (an entry without it is in the default's)."""
        group = self.user_groups.get(user)
        share = self.user_shares.get(user)
        if group == self.default_group:
            value = _limit_value(self.user_rates[user], share)
        else:
            value = _limit_value(self.user_rates[user], share, group, group_key=True)
        pace = self.user_min_stream_tokens_per_second.get(user)
        if pace is None:
            return value
        value = dict(value) if isinstance(value, Mapping) else {"rate": value}
        value[MIN_PACE_KEY] = pace
        return value

    def min_pace_of(self, user: str) -> float:
        """``user``'s minimum pace per resident stream (0: no residency cap)."""
        return self.user_min_stream_tokens_per_second.get(user, self.min_stream_tokens_per_second)

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None
    ) -> "OutputRateSettings | None":
        """Settings from vLLM's ``additional_config``; None when the feature is off."""
        if not additional_config or CONFIG_KEY not in additional_config:
            return None
        section = additional_config[CONFIG_KEY]
        where = f"additional_config[{CONFIG_KEY!r}]"
        if section is None:
            return None
        if not isinstance(section, Mapping):
            raise OutputRateConfigError(
                f"{where} must be an object, got {type(section).__name__}"
            )
        unknown = sorted(set(section) - _SECTION_KEYS, key=repr)
        if unknown:
            raise OutputRateConfigError(f"{where}: unknown keys {unknown}")
        max_users = validate_max_users(
            section.get(METRICS_MAX_USERS_KEY, DEFAULT_METRICS_MAX_USERS),
            f"{where}[{METRICS_MAX_USERS_KEY!r}]",
        )
        recompute_budget = validate_recompute_budget(
            section.get(RECOMPUTE_BUDGET_KEY, DEFAULT_RECOMPUTE_RATIO),
            f"{where}[{RECOMPUTE_BUDGET_KEY!r}]",
        )
        input_token_weight = validate_input_token_weight(
            section.get(INPUT_TOKEN_WEIGHT_KEY, 0), f"{where}[{INPUT_TOKEN_WEIGHT_KEY!r}]"
        )
        min_pace = validate_min_pace(
            section.get(MIN_PACE_KEY, DEFAULT_MIN_STREAM_TOKENS_PER_SECOND),
            f"{where}[{MIN_PACE_KEY!r}]",
        )
        mode = validate_mode(section.get(MODE_KEY, ENFORCE), f"{where}[{MODE_KEY!r}]")
        burst = validate_burst(section.get(BURST_KEY, DEFAULT_BURST_SECONDS), f"{where}[{BURST_KEY!r}]")
        try:
            store = parse_store_section(section.get(STORE_KEY))
        except ValueError as exc:
            raise OutputRateConfigError(f"{where}[{STORE_KEY!r}]: {exc}") from None
        limits_file = section.get(LIMITS_FILE_KEY)
        if limits_file is not None:
            # The file wins over rates given next to it (flags or keys).
            if not isinstance(limits_file, str) or not limits_file:
                raise OutputRateConfigError(
                    f"{where}[{LIMITS_FILE_KEY!r}]: must be a file path"
                )
            rates = load_limits_file(limits_file, input_token_weight, min_pace, mode)
            return dataclasses.replace(
                rates,
                limits_file=limits_file,
                metrics_max_users=max_users,
                store=store,
                recompute_budget=recompute_budget,
                burst_seconds=burst,
            )
        default = section.get(DEFAULT_KEY)
        overrides = _null_is_empty(section.get(OVERRIDES_KEY))
        groups = _null_is_empty(section.get(GROUPS_KEY))
        whats = tuple(f"{where}[{key!r}]" for key in (DEFAULT_KEY, OVERRIDES_KEY, GROUPS_KEY))
        if default is None:
            for value, what, validate in (
                (overrides, whats[1], validate_grouped_limits), (groups, whats[2], validate_groups)
            ):
                if not isinstance(value, Mapping):  # 0, [], false: an error, not "none"
                    validate(value, what)  # raises: not an object
                if value:
                    raise OutputRateConfigError(f"{what} requires {DEFAULT_KEY!r}")
            return None
        limits = validate_all_limits(default, overrides, groups, whats)
        return cls(
            **limits,
            metrics_max_users=max_users,
            store=store,
            recompute_budget=recompute_budget,
            input_token_weight=input_token_weight,
            min_stream_tokens_per_second=min_pace,
            mode=mode,
            burst_seconds=burst,
        )

    def rate_of(self, user: str) -> float:
        return self.user_rates.get(user, self.default_rate)

    def default_limit(self) -> tuple[float, float | None, float]:
        """(rate, ceil, weight) of every user without an entry of its own."""
        share = self.default_share
        rate = self.default_rate
        return (rate, rate, rate) if share is None else (rate, share.ceil, share.weight)

    def limit_of(self, user: str) -> tuple[float, float | None, float]:
        """``user``'s (rate, ceil, weight); ceil None: no ceiling."""
        if user in self.user_rates:
            rate, share = self.user_rates[user], self.user_shares.get(user)
        else:
            rate, share = self.default_rate, self.default_share
        return (rate, rate, rate) if share is None else (rate, share.ceil, share.weight)

    def share_table(self) -> ShareTable:
        """The rates with their ceilings and weights, for borrowing."""
        return ShareTable(self.default_rate, self.user_rates, self.default_share, self.user_shares)

    def group_of(self, user: str) -> str | None:
        """``user``'s group (None: it belongs to none)."""
        if user in self.user_rates:
            return self.user_groups.get(user)
        return self.default_group

    def group_limit_of(self, group: str) -> tuple[float, float | None, float]:
        """``group``'s (rate, ceil, weight), as :meth:`limit_of`."""
        rate, share = self.group_rates[group], self.group_shares.get(group)
        return (rate, rate, rate) if share is None else (rate, share.ceil, share.weight)

    def group_table(self) -> ShareTable:
        """The groups' rates, ceilings and weights (every group is named: the
        table's default is never asked)."""
        return ShareTable(self.default_rate, self.group_rates, None, self.group_shares)

    def borrows(self) -> bool:
        """Does any user have a ceiling above its rate (or none)?"""
        return self.share_table().any_borrower()


def limits_view(settings: OutputRateSettings) -> dict[str, Any]:
    """What a limits file sets, one entry per user, group and top-level
    key (``user_output_tokens_per_second.alice``), each as it would be
    written: the audit trail compares two of these."""
    config = settings.to_config()
    view: dict[str, Any] = {
        DEFAULT_KEY: config[DEFAULT_KEY],
        INPUT_TOKEN_WEIGHT_KEY: settings.input_token_weight,
        MIN_PACE_KEY: settings.min_stream_tokens_per_second,
        MODE_KEY: settings.mode,
    }
    for section in (OVERRIDES_KEY, GROUPS_KEY):
        for name, value in config.get(section, {}).items():
            view[f"{section}.{name}"] = value
    return view


#: Keys of a rate given as a mapping.
LIMIT_KEYS = ("rate", "ceil", "weight")


def _limit_value(
    rate: float, share: Share | None, group: str | None = None, group_key: bool = False
) -> Any:
    """A rate as written in the config: a number, or ``{rate, ceil, weight}``
    (with the key ``group``, possibly null, when ``group_key``)."""
    if share is None and not group_key:
        return rate
    value: dict[str, Any] = {"rate": rate}
    if share is not None:
        value.update(ceil=share.ceil, weight=share.weight)
    if group_key:
        value[GROUP_KEY] = group
    return value


def _null_is_empty(value: Any) -> Any:
    """An absent or null users / groups key means none; any other value is
    checked by the validators (``0``, ``[]``, ``false`` are refused there)."""
    return {} if value is None else value


def _check_name(name: Any, what: str, kind: str) -> None:
    """A user or group name: a non-empty string, not too long, not reserved."""
    if not isinstance(name, str) or not name:
        raise OutputRateConfigError(f"{what}: {kind} names must be non-empty strings")
    if len(name) > MAX_USER_LEN:
        raise OutputRateConfigError(f"{what}: {kind} name longer than {MAX_USER_LEN} characters")
    if name in RESERVED_NAMES:
        raise OutputRateConfigError(
            f"{what}: {kind} name {name!r} is reserved (the metrics' row of all other users)"
        )


def validate_limit(value: Any, what: str) -> tuple[float, Share | None]:
    """A rate (a number: a hard cap) or ``{rate, ceil, weight}``.

    ``ceil`` defaults to the rate (a hard cap), ``null`` is no ceiling;
    ``weight`` defaults to the rate.  Errors name ``what`` and the key.
    """
    if not isinstance(value, Mapping):
        return validate_rate(value, what), None
    unknown = sorted((str(k) for k in value if k not in LIMIT_KEYS))
    if unknown:
        if GROUP_KEY in unknown:
            raise OutputRateConfigError(
                f"{what}: a group cannot belong to a group (one level of groups); "
                f"'{GROUP_KEY}' is a key of users' limits"
            )
        raise OutputRateConfigError(
            f"{what}: must be a number or {{rate, ceil, weight}}; unknown keys {unknown}"
        )
    if value.get("rate") is None:
        raise OutputRateConfigError(f"{what}: 'rate' is required")
    rate = validate_rate(_no_text(value["rate"], f"{what}['rate']"), f"{what}['rate']")
    ceil: float | None = rate
    if "ceil" in value:
        raw = value["ceil"]
        ceil = None if raw is None else validate_rate(_no_text(raw, f"{what}['ceil']"), f"{what}['ceil']")
        if ceil is not None and ceil < rate:
            raise OutputRateConfigError(f"{what}['ceil']: must be at least the rate {rate:g}, got {raw!r}")
    weight = rate
    if "weight" in value:
        weight = validate_rate(_no_text(value["weight"], f"{what}['weight']"), f"{what}['weight']")
    return rate, Share(ceil, weight)


def _no_text(value: Any, what: str) -> Any:
    if isinstance(value, str):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    return value


def validate_limits(value: Any, what: str) -> tuple[dict[str, float], dict[str, Share]]:
    """Per-user limits: (user -> rate, user -> share for those given as mappings)."""
    user_rates, shares, _ = validate_grouped_limits(value, what, ANY_GROUP)
    return user_rates, shares


class _AnyGroup:
    """Accept every group name (a flag checked alone, before the groups are known)."""

    def __contains__(self, group: object) -> bool:
        return True


#: ``groups`` argument of the validators that checks no group reference.
ANY_GROUP: Any = _AnyGroup()


def _user_group(
    value: Any, what: str, groups: Any, inherited: str | None = None
) -> tuple[Any, str | None]:
    """``value`` without its ``group`` key, and that group (checked against
    ``groups``): ``inherited`` without the key, None for ``"group": null``."""
    if not isinstance(value, Mapping) or GROUP_KEY not in value:
        return value, inherited
    group = value[GROUP_KEY]
    where = f"{what}[{GROUP_KEY!r}]"
    if group is None:  # explicitly in no group
        return {k: v for k, v in value.items() if k != GROUP_KEY}, None
    if not isinstance(group, str) or not group:
        raise OutputRateConfigError(f"{where}: must be a group name, got {group!r}")
    if group not in groups:
        known = sorted(groups)
        raise OutputRateConfigError(
            f"{where}: unknown group {group!r} ("
            + (f"groups: {known}" if known else f"no {GROUPS_KEY!r} configured") + ")"
        )
    return {k: v for k, v in value.items() if k != GROUP_KEY}, group


def _user_pace(value: Any, what: str) -> tuple[Any, float | None]:
    """``value`` without its minimum pace key, and that pace (validated)."""
    if not isinstance(value, Mapping) or MIN_PACE_KEY not in value:
        return value, None
    pace = validate_min_pace(value[MIN_PACE_KEY], f"{what}[{MIN_PACE_KEY!r}]")
    return {k: v for k, v in value.items() if k != MIN_PACE_KEY}, pace


def validate_grouped_limits(
    value: Any, what: str, groups: Any = (), default_group: str | None = None,
    paces: dict[str, float] | None = None,
) -> tuple[dict[str, float], dict[str, Share], dict[str, str]]:
    """Per-user limits, each may name one of ``groups``: (user -> rate, user ->
    share for those given as mappings, user -> group for those in one).
    ``paces`` receives each user's own ``min_stream_tokens_per_second``.

    An entry without the key ``group`` is in ``default_group`` (the
    default's group: a rate of its own does not take a user out of it);
    ``"group": null`` puts it in none."""
    if not isinstance(value, Mapping):
        validate_overrides(value, what)  # raises: not a mapping
    user_rates: dict[str, float] = {}
    shares: dict[str, Share] = {}
    user_groups: dict[str, str] = {}
    for user, limit in value.items():
        validate_overrides({user: 1}, what)  # the checks of a user name
        if isinstance(limit, str):
            raise OutputRateConfigError(f"{what}[{user!r}]: must be a number, got {limit!r}")
        limit, pace = _user_pace(limit, f"{what}[{user!r}]")
        if pace is not None and paces is not None:
            paces[user] = pace
        limit, group = _user_group(limit, f"{what}[{user!r}]", groups, default_group)
        rate, share = validate_limit(limit, f"{what}[{user!r}]")
        user_rates[user] = rate
        if share is not None:
            shares[user] = share
        if group is not None:
            user_groups[user] = group
    return user_rates, shares, user_groups


def validate_groups(value: Any, what: str) -> tuple[dict[str, float], dict[str, Share]]:
    """Groups: ``{group: limit}``, names and limits checked as users' (a
    group names no group: one level)."""
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{what}: must be an object of group -> limit, got {type(value).__name__}"
        )
    rates: dict[str, float] = {}
    shares: dict[str, Share] = {}
    for group, limit in value.items():
        _check_name(group, what, "group")
        if isinstance(limit, str):
            raise OutputRateConfigError(f"{what}[{group!r}]: must be a number, got {limit!r}")
        rates[group], share = validate_limit(limit, f"{what}[{group!r}]")
        if share is not None:
            shares[group] = share
    return rates, shares


def validate_all_limits(
    default: Any, overrides: Any, groups: Any, what: tuple[str, str, str], check_groups: bool = True
) -> dict[str, Any]:
    """The default, per-user limits and groups, validated together (a user's
    group must be one of the groups): keyword arguments of
    :class:`OutputRateSettings`."""
    where_default, where_users, where_groups = what
    group_rates, group_shares = validate_groups(groups, where_groups)
    known = group_rates if check_groups else ANY_GROUP
    default, default_group = _user_group(default, where_default, known)
    default_rate, default_share = validate_limit(default, where_default)
    paces: dict[str, float] = {}
    user_rates, user_shares, user_groups = validate_grouped_limits(
        overrides, where_users, known, default_group, paces
    )
    return dict(
        default_rate=default_rate, default_share=default_share, default_group=default_group,
        user_rates=user_rates, user_shares=user_shares, user_groups=user_groups,
        group_rates=group_rates, group_shares=group_shares,
        user_min_stream_tokens_per_second=paces,
    )


def _from_text(value: Any, what: str, kind: str = "a number") -> Any:
    """A flag's text as a float (JSON and YAML give numbers); anything else as given."""
    if not isinstance(value, str):
        return value
    try:
        return float(value.strip())
    except ValueError:
        raise OutputRateConfigError(f"{what}: must be {kind}, got {value!r}") from None


def validate_rate(value: Any, what: str) -> float:
    """A rate (or ceiling, or weight) in [MIN_RATE, MAX_RATE], or
    OutputRateConfigError naming ``what``."""
    if isinstance(value, bool):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    value = _from_text(value, what)
    if not isinstance(value, (int, float)):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range (JSON ints are unbounded)
        raise OutputRateConfigError(
            f"{what}: too large, got an integer beyond float range"
        ) from None
    if math.isnan(as_float):
        raise OutputRateConfigError(f"{what}: must be a number, got NaN")
    if math.isinf(as_float):
        raise OutputRateConfigError(f"{what}: must be finite, got {value!r}")
    if as_float <= 0:
        raise OutputRateConfigError(f"{what}: must be positive, got {value!r}")
    if not MIN_RATE <= as_float <= MAX_RATE:
        raise OutputRateConfigError(
            f"{what}: must be between {MIN_RATE:g} and {MAX_RATE:g} (what the shared store "
            f"and the borrowing counters represent), got {value!r}"
        )
    return as_float


def validate_min_pace(value: Any, what: str) -> float:
    """A minimum pace per resident stream: 0 (no residency cap) or a rate
    in [MIN_RATE, MAX_RATE], or OutputRateConfigError naming ``what``."""
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
        return 0.0
    if isinstance(value, str):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    try:
        return validate_rate(value, what)
    except OutputRateConfigError as exc:
        raise OutputRateConfigError(f"{exc} (0 turns the residency cap off)") from None


def validate_overrides(value: Any, what: str) -> dict[str, float]:
    """A mapping of non-empty user name -> positive finite rate."""
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{what}: must be a JSON object of user -> tokens/s, got {type(value).__name__}"
        )
    rates: dict[str, float] = {}
    for user, rate in value.items():
        _check_name(user, what, "user")
        if isinstance(rate, str):  # JSON rates are numbers, not numeric text
            raise OutputRateConfigError(f"{what}[{user!r}]: must be a number, got {rate!r}")
        rates[user] = validate_rate(rate, f"{what}[{user!r}]")
    return rates


def _reject_json_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid rate")


def _json_flag(text: str, flag: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_json_constant)
    except ValueError as exc:
        raise OutputRateConfigError(f"{flag}: malformed JSON ({exc})") from None


def parse_cli(
    default: str | None,
    overrides: str | None,
    groups: str | None = None,
    check_groups: bool = True,
) -> dict[str, Any] | None:
    """Parse the rate flags into the ``additional_config`` dict (None when off).

    ``check_groups=False`` accepts any group a user names (a flag checked
    alone, before the groups flag is seen); the whole command line is parsed
    again with it on.
    """
    if default is None:
        for flag, value in ((OVERRIDES_FLAG, overrides), (GROUPS_FLAG, groups)):
            if value is not None:
                raise OutputRateConfigError(f"{flag} requires {DEFAULT_FLAG}")
        return None
    decoded = {} if overrides is None else _json_flag(overrides, OVERRIDES_FLAG)
    decoded_groups = {} if groups is None else _json_flag(groups, GROUPS_FLAG)
    default_value: Any = default
    if default.strip().startswith("{"):  # {"rate": .., "ceil": .., "weight": ..}
        default_value = _json_flag(default, DEFAULT_FLAG)
    limits = validate_all_limits(
        default_value, decoded, decoded_groups, (DEFAULT_FLAG, OVERRIDES_FLAG, GROUPS_FLAG),
        check_groups=check_groups,
    )
    return OutputRateSettings(**limits).to_config()


def resolve_user(extra_args: Mapping[str, Any] | None) -> str:
    """The rate-limit identity of a request, from its ``extra_args``.

    Missing -> the shared anonymous user.  Anything other than a non-empty
    string of at most ``MAX_USER_LEN`` characters raises InvalidUserError.
    """
    if not extra_args or USER_ARG not in extra_args:
        return ANONYMOUS_USER
    user = extra_args[USER_ARG]
    if not isinstance(user, str):
        raise InvalidUserError(
            f"vllm_xargs.{USER_ARG} must be a string, got {type(user).__name__}"
        )
    if not user:
        raise InvalidUserError(f"vllm_xargs.{USER_ARG} must not be empty")
    if len(user) > MAX_USER_LEN:
        raise InvalidUserError(
            f"vllm_xargs.{USER_ARG} must be at most {MAX_USER_LEN} characters"
        )
    return user


def validate_max_users(value: Any, what: str) -> int:
    """A non-negative integer count of per-user metric series."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OutputRateConfigError(f"{what}: must be a non-negative integer, got {value!r}")
    return value


def _shown(value: Any) -> str:
    """``repr(value)``, except an integer too long for a one-line message."""
    if isinstance(value, int) and not -10**20 < value < 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _ratio(value: Any, what: str, problem: str) -> float:
    """A number in [0, MAX_RATIO]; ``problem`` says what a refused value must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_RATIO:
        # Compared before float(): an int beyond float range is refused, not an OverflowError.
        raise OutputRateConfigError(f"{what}: {problem}, at most {MAX_RATIO:g}; got {_shown(value)}")
    return float(value)


def validate_input_token_weight(value: Any, what: str) -> float:
    """Quota tokens per computed prompt token, in [0, MAX_RATIO]."""
    value = _from_text(value, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    return _ratio(value, what, "must be a non-negative finite number")


def validate_recompute_budget(value: Any, what: str) -> float:
    """Recomputed tokens per request scheduled, in [0, MAX_RATIO]."""
    return _ratio(value, what, "must be a non-negative number")


def validate_burst(value: Any, what: str) -> float:
    """A burst in seconds, in [MIN_BURST_SECONDS, MAX_BURST_SECONDS]."""
    value = _from_text(value, what, "a number of seconds")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        MIN_BURST_SECONDS <= value <= MAX_BURST_SECONDS
    ):
        raise OutputRateConfigError(
            f"{what}: must be a number of seconds between {MIN_BURST_SECONDS:g} and "
            f"{MAX_BURST_SECONDS:g}, got {_shown(value)}"
        )
    return float(value)


def validate_mode(value: Any, what: str) -> str:
    """``enforce`` or ``shadow``, or OutputRateConfigError naming ``what``."""
    if value not in MODES or not isinstance(value, str):
        raise OutputRateConfigError(f"{what}: must be one of {list(MODES)}, got {_shown(value)}")
    return value


# -- files (limits, API keys) --------------------------------------------------------


def read_mapping_file(path: str, what: str) -> Mapping[str, Any]:
    """A JSON or YAML file holding one object; OutputRateConfigError otherwise.

    ``.json`` files are read as JSON; anything else as YAML (a superset of
    JSON), so either format works under any name.
    """
    return _parse_mapping(_read_bytes(path, what), path, what)


def _read_bytes(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise OutputRateConfigError(f"{what} {path!r}: cannot read ({exc.strerror})") from None


def _parse_mapping(raw: bytes, path: str, what: str) -> Mapping[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OutputRateConfigError(
            f"{what} {path!r}: cannot read (not UTF-8 text: byte {exc.start})"
        ) from None
    try:
        if path.endswith(".json"):
            data = json.loads(text, parse_constant=_reject_json_constant)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # JSON and YAML parse errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OutputRateConfigError(f"{what} {path!r}: cannot parse ({first})") from None
    if not isinstance(data, Mapping):
        raise OutputRateConfigError(
            f"{what} {path!r}: must hold an object, got {type(data).__name__}"
        )
    return data


def load_limits_file(
    path: str,
    input_token_weight: float = 0.0,
    min_pace: float = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
    mode: str = ENFORCE,
) -> OutputRateSettings:
    """Rates from a limits file, validated as a whole.

    The file holds the same keys as ``additional_config["output_rate"]``::

        default_user_output_tokens_per_second: 100
        user_output_tokens_per_second: {user-a: 20, user-b: {rate: 10, ceil: 500, group: team}}
        groups: {team: {rate: 300, ceil: 600}}   # optional
        input_token_weight: 0.5        # optional
        min_stream_tokens_per_second: 1  # optional
        mode: shadow                   # optional: enforce or shadow

    The default is required (the file alone turns the feature on).  A file
    without ``input_token_weight`` keeps ``input_token_weight`` (the flag's),
    one without ``min_stream_tokens_per_second`` keeps ``min_pace``, one
    without ``mode`` keeps ``mode``.
    The settings' ``limits_digest`` is the hex SHA-256 of the very bytes
    parsed (which version of the file is in force, for the audit trail).
    """
    what = f"{LIMITS_FILE_FLAG}"
    raw = _read_bytes(path, what)
    data = _parse_mapping(raw, path, what)
    unknown = sorted(set(data) - set(LIMITS_FILE_KEYS), key=repr)
    if unknown:
        raise OutputRateConfigError(f"{what} {path!r}: unknown keys {unknown}")
    if data.get(DEFAULT_KEY) is None:
        raise OutputRateConfigError(f"{what} {path!r}: {DEFAULT_KEY!r} is required")
    default = data[DEFAULT_KEY]
    if isinstance(default, str):
        raise OutputRateConfigError(
            f"{what} {path!r}[{DEFAULT_KEY!r}]: must be a number, got {default!r}"
        )
    limits = validate_all_limits(
        default, _null_is_empty(data.get(OVERRIDES_KEY)), _null_is_empty(data.get(GROUPS_KEY)),
        tuple(f"{what} {path!r}[{key!r}]" for key in (DEFAULT_KEY, OVERRIDES_KEY, GROUPS_KEY)),
    )
    settings = OutputRateSettings(
        **limits,
        input_token_weight=validate_input_token_weight(
            data.get(INPUT_TOKEN_WEIGHT_KEY, input_token_weight),
            f"{what} {path!r}[{INPUT_TOKEN_WEIGHT_KEY!r}]",
        ),
        min_stream_tokens_per_second=validate_min_pace(
            data.get(MIN_PACE_KEY, min_pace), f"{what} {path!r}[{MIN_PACE_KEY!r}]"
        ),
        mode=validate_mode(data.get(MODE_KEY, mode), f"{what} {path!r}[{MODE_KEY!r}]"),
    )
    return dataclasses.replace(settings, limits_digest=hashlib.sha256(raw).hexdigest())


def load_limits_version(
    path: str,
    input_token_weight: float = 0.0,
    min_pace: float = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
    mode: str = ENFORCE,
) -> tuple[OutputRateSettings, str]:
    """:func:`load_limits_file` and the digest of the version it read."""
    settings = load_limits_file(path, input_token_weight, min_pace, mode)
    assert settings.limits_digest is not None
    return settings, settings.limits_digest


def file_signature(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten or replaced (None: missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


#: Prefix marking a stored key as the hex SHA-256 of the real key.
SHA256_PREFIX = "sha256:"


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path: str, what: str = "--output-rate-api-keys") -> dict[bytes, str]:
    """API keys file -> {sha256 digest of the key: user}.

    The file maps each key to its user; a key written ``sha256:<64 hex>``
    is stored as the SHA-256 of the real key, so the file need not hold
    secrets.  Keys are kept only as digests (compared in constant time by
    the caller).
    """
    data = read_mapping_file(path, what)
    if not data:
        raise OutputRateConfigError(f"{what} {path!r}: no keys")
    keys: dict[bytes, str] = {}
    for key, user in data.items():
        if not isinstance(key, str) or not key:
            raise OutputRateConfigError(f"{what} {path!r}: keys must be non-empty strings")
        if not isinstance(user, str) or not user or len(user) > MAX_USER_LEN:
            raise OutputRateConfigError(
                f"{what} {path!r}: the user of each key must be a non-empty string "
                f"of at most {MAX_USER_LEN} characters"
            )
        if key.startswith(SHA256_PREFIX):
            hexdigest = key[len(SHA256_PREFIX):]
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise OutputRateConfigError(
                    f"{what} {path!r}: {SHA256_PREFIX}... must be followed by 64 hex digits"
                )
        else:
            digest = hash_api_key(key)
        if digest in keys:
            raise OutputRateConfigError(f"{what} {path!r}: the same key is listed twice")
        keys[digest] = user
    return keys
