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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

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


class OutputRateConfigError(ValueError):
    """A rate-limit setting is invalid; the message names the setting."""


class InvalidUserError(ValueError):
    """A request's ``output_rate_user`` value is not a usable identity."""


@dataclass(frozen=True)
class OutputRateSettings:
    """Validated per-user output rates (tokens per second)."""

    default_rate: float
    user_rates: Mapping[str, float] = field(default_factory=dict)

    def to_config(self) -> dict[str, Any]:
        """The ``additional_config["output_rate"]`` form of these settings."""
        return {DEFAULT_KEY: self.default_rate, OVERRIDES_KEY: dict(self.user_rates)}

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
        unknown = sorted(set(section) - {DEFAULT_KEY, OVERRIDES_KEY}, key=repr)
        if unknown:
            raise OutputRateConfigError(f"{where}: unknown keys {unknown}")
        default = section.get(DEFAULT_KEY)
        overrides = section.get(OVERRIDES_KEY)
        if default is None:
            if overrides:
                raise OutputRateConfigError(
                    f"{where}[{OVERRIDES_KEY!r}] requires {DEFAULT_KEY!r}"
                )
            return None
        return cls(
            default_rate=validate_rate(default, f"{where}[{DEFAULT_KEY!r}]"),
            user_rates=validate_overrides(overrides or {}, f"{where}[{OVERRIDES_KEY!r}]"),
        )


def validate_rate(value: Any, what: str) -> float:
    """A positive finite rate, or OutputRateConfigError naming ``what``."""
    if isinstance(value, bool):
        raise OutputRateConfigError(f"{what}: must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise OutputRateConfigError(f"{what}: must be a number, got {value!r}") from None
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
    return as_float


def validate_overrides(value: Any, what: str) -> dict[str, float]:
    """A mapping of non-empty user name -> positive finite rate."""
    if not isinstance(value, Mapping):
        raise OutputRateConfigError(
            f"{what}: must be a JSON object of user -> tokens/s, got {type(value).__name__}"
        )
    rates: dict[str, float] = {}
    for user, rate in value.items():
        if not isinstance(user, str) or not user:
            raise OutputRateConfigError(f"{what}: user names must be non-empty strings")
        if len(user) > MAX_USER_LEN:
            raise OutputRateConfigError(
                f"{what}: user name longer than {MAX_USER_LEN} characters"
            )
        if isinstance(rate, str):  # JSON rates are numbers, not numeric text
            raise OutputRateConfigError(f"{what}[{user!r}]: must be a number, got {rate!r}")
        rates[user] = validate_rate(rate, f"{what}[{user!r}]")
    return rates


def _reject_json_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid rate")


def parse_cli(default: str | None, overrides: str | None) -> dict[str, Any] | None:
    """Parse the two flags into the ``additional_config`` dict (None when off)."""
    if default is None:
        if overrides is not None:
            raise OutputRateConfigError(f"{OVERRIDES_FLAG} requires {DEFAULT_FLAG}")
        return None
    rates: dict[str, float] = {}
    if overrides is not None:
        try:
            decoded = json.loads(overrides, parse_constant=_reject_json_constant)
        except ValueError as exc:
            raise OutputRateConfigError(f"{OVERRIDES_FLAG}: malformed JSON ({exc})") from None
        rates = validate_overrides(decoded, OVERRIDES_FLAG)
    settings = OutputRateSettings(
        default_rate=validate_rate(default, DEFAULT_FLAG), user_rates=rates
    )
    return settings.to_config()


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
