"""``vllm serve`` flags for operating the feature in a shared cluster.

Identity (front end), the limits file (engine, re-read on change), the
per-user metrics bound (engine) and the admin key (front end).  Added in their
own group by :func:`.patches.add_output_rate_args`; merged by
:func:`.patches.merge_cli_into_engine_args` through :func:`merge_operate_args`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable

from vllm_output_rate.settings import (
    BURST_FLAG,
    BURST_KEY,
    DEFAULT_BURST_SECONDS,
    DEFAULT_FLAG,
    DEFAULT_METRICS_MAX_USERS,
    INPUT_TOKEN_WEIGHT_FLAG,
    INPUT_TOKEN_WEIGHT_KEY,
    LIMITS_FILE_FLAG,
    LIMITS_FILE_KEY,
    METRICS_MAX_USERS_FLAG,
    METRICS_MAX_USERS_KEY,
    MIN_PACE_FLAG,
    MIN_PACE_KEY,
    RECOMPUTE_BUDGET_FLAG,
    RECOMPUTE_BUDGET_KEY,
    OutputRateConfigError,
    load_limits_file,
    validate_burst,
    validate_input_token_weight,
    validate_min_pace,
    validate_recompute_budget,
)
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.policy.eviction import DEFAULT_RECOMPUTE_RATIO
from vllm_output_rate.stores.config import int_arg

from .identity import (
    API_KEYS_FLAG,
    DEFAULT_USER_HEADER,
    IDENTITY_FLAG,
    MODES,
    UNKNOWN_USER_POLICIES,
    UNKNOWN_USERS_FLAG,
    USER_HEADER_FLAG,
    install_middleware,
)
from .admin import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_FILE_FLAG,
    ADMIN_KEY_FLAG,
    ADMIN_OPEN_FLAG,
    AdminAccess,
    admin_key_arg,
)

logger = logging.getLogger(__name__)


def _validated_number(validate: Callable[[object, str], float]) -> Callable[[str], float]:
    """An argparse ``type`` that parses a number and checks it with the
    settings' own validator (one message, wherever the value comes from)."""

    def parse(text: str) -> float:
        try:
            value: object = float(text)
        except ValueError:
            value = text  # refused by the validator, with the text in its message
        try:
            return validate(value, "value")
        except OutputRateConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    return parse


def _input_token_weight_arg(text: str) -> float:
    try:
        return validate_input_token_weight(text, "value")
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


def add_operate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        title="OutputRate operation",
        description="Identity, live limits, metrics and admin route of the "
        "vllm-output-rate plugin (see its README).",
    )
    group.add_argument(
        LIMITS_FILE_FLAG,
        dest="output_rate_limits_file",
        default=None,
        metavar="FILE",
        help="JSON or YAML file with default_user_output_tokens_per_second and "
        "optionally user_output_tokens_per_second, groups, input_token_weight and "
        "min_stream_tokens_per_second. "
        "Turns the feature on by itself, wins over the rate flags, and is re-read "
        "within about a second when it changes "
        "(a file that fails validation is rejected whole; the old limits stay).",
    )
    group.add_argument(
        IDENTITY_FLAG,
        dest="output_rate_identity",
        choices=MODES,
        default="body",
        help="Where the rate-limit user comes from: body (vllm_xargs.output_rate_user, "
        "not authenticated), header (an HTTP header set by a trusted gateway), "
        f"api-key (Authorization: Bearer KEY looked up in {API_KEYS_FLAG}).",
    )
    group.add_argument(
        USER_HEADER_FLAG,
        dest="output_rate_user_header",
        default=DEFAULT_USER_HEADER,
        metavar="NAME",
        help="Header holding the user in header mode (a request without it is "
        "the anonymous user's, or refused under --output-rate-unknown-users reject).",
    )
    group.add_argument(
        API_KEYS_FLAG,
        dest="output_rate_api_keys",
        default=None,
        metavar="FILE",
        help="JSON or YAML object key -> user for api-key mode; a key may be "
        "written sha256:<hex digest of the key>.",
    )
    group.add_argument(
        UNKNOWN_USERS_FLAG,
        dest="output_rate_unknown_users",
        choices=UNKNOWN_USER_POLICIES,
        default="default",
        help="reject: in header / api-key mode, refuse (403) users without their "
        "own entry in the limits, and refuse (401) requests without the header.",
    )
    group.add_argument(
        METRICS_MAX_USERS_FLAG,
        dest="output_rate_metrics_max_users",
        type=int_arg(0),
        default=None,
        metavar="K",
        help="Per-user metric series for users without a configured limit "
        f"(default {DEFAULT_METRICS_MAX_USERS}); the rest are summed as user=\"__other__\".",
    )
    group.add_argument(
        RECOMPUTE_BUDGET_FLAG,
        dest="output_rate_recompute_budget",
        type=_validated_number(validate_recompute_budget),
        default=None,
        metavar="RATIO",
        help="Recomputed tokens that evicting throttled requests to make room for "
        "other users' waiting requests may cost, per request scheduled "
        f"(default {DEFAULT_RECOMPUTE_RATIO}); 0 never evicts for a waiting request.",
    )
    group.add_argument(
        MIN_PACE_FLAG,
        dest="output_rate_min_stream_tokens_per_second",
        type=_validated_number(validate_min_pace),
        default=None,
        metavar="TOKENS_PER_S",
        help="Minimum pace of one resident stream: a user's requests get KV only as far "
        "as its quota keeps each moving at this pace, at most max(1, floor(rate / pace)) "
        f"of them (default {DEFAULT_MIN_STREAM_TOKENS_PER_SECOND:g}); 0 turns the cap off. "
        "Per user: the key min_stream_tokens_per_second of its {rate, ...}.",
    )
    group.add_argument(
        BURST_FLAG,
        dest="output_rate_burst_seconds",
        type=_validated_number(validate_burst),
        default=None,
        metavar="SECONDS",
        help="How far every quota may run ahead of its rate: in any W seconds a user gets at "
        f"most (W + burst) x its rate + 1 tokens (default {DEFAULT_BURST_SECONDS:g}). One step "
        "takes at most burst x rate + 1 of them, so set it at least the engine's longest "
        "step (a GPU at hundreds of running requests: 0.2-0.3 s), or capped users get less "
        "than their limit.",
    )
    group.add_argument(
        INPUT_TOKEN_WEIGHT_FLAG,
        dest="output_rate_input_token_weight",
        type=_input_token_weight_arg,
        default=None,
        metavar="WEIGHT",
        help="Tokens of the user's quota each computed prompt token costs, charged "
        "at dispatch (prefix-cache hits and recompute after preemption are free); "
        "default 0: prompt tokens are free. A limits file's input_token_weight wins.",
    )
    group.add_argument(
        ADMIN_KEY_FLAG,
        dest="output_rate_admin_key",
        default=None,
        type=admin_key_arg,
        metavar="KEY",
        help="Bearer key required by GET /v1/output_rate/users (endpoint plugin); "
        f"never logged. Also {ADMIN_KEY_FILE_FLAG} or ${ADMIN_KEY_ENV}. Without a key "
        f"the route answers 403 unless {ADMIN_OPEN_FLAG} is given.",
    )
    group.add_argument(
        ADMIN_KEY_FILE_FLAG,
        dest="output_rate_admin_key_file",
        default=None,
        metavar="PATH",
        help=f"File holding the admin key (read at startup), instead of {ADMIN_KEY_FLAG}.",
    )
    group.add_argument(
        ADMIN_OPEN_FLAG,
        dest="output_rate_admin_open",
        action="store_true",
        help="Serve GET /v1/output_rate/users to anyone, without a key "
        "(only behind a network boundary you trust).",
    )


def merge_operate_args(args: argparse.Namespace, section: dict | None) -> dict | None:
    """Fold the operating flags into the ``output_rate`` section (None: feature off)."""
    limits_file = getattr(args, "output_rate_limits_file", None)
    if limits_file:
        load_limits_file(limits_file)  # a bad file stops startup with its one-line error
        if section is not None:
            logger.warning(
                "vllm-output-rate: %s given: its rates win over %s and "
                "--user-output-tokens-per-second", LIMITS_FILE_FLAG, DEFAULT_FLAG,
            )
        section = dict(section or {})
        section[LIMITS_FILE_KEY] = os.path.abspath(limits_file)
    max_users = getattr(args, "output_rate_metrics_max_users", None)
    recompute_budget = getattr(args, "output_rate_recompute_budget", None)
    input_token_weight = getattr(args, "output_rate_input_token_weight", None)
    min_pace = getattr(args, "output_rate_min_stream_tokens_per_second", None)
    burst = getattr(args, "output_rate_burst_seconds", None)
    identity = getattr(args, "output_rate_identity", None) or "body"
    AdminAccess.from_args(args)  # a bad key file or a contradiction stops startup
    if section is None:
        _refuse_identity_flags_while_off(args)
        _warn_admin_flags_while_off(args)
        _warn_header_flag_in_body_mode(args, identity)
        if identity != "body" or max_users is not None or recompute_budget is not None:
            raise OutputRateConfigError(
                f"{IDENTITY_FLAG} / {METRICS_MAX_USERS_FLAG} / {RECOMPUTE_BUDGET_FLAG} need "
                f"the feature on ({DEFAULT_FLAG} or {LIMITS_FILE_FLAG})"
            )
        for value, flag in (
            (input_token_weight, INPUT_TOKEN_WEIGHT_FLAG), (min_pace, MIN_PACE_FLAG), (burst, BURST_FLAG)
        ):
            if value is not None:
                raise OutputRateConfigError(
                    f"{flag} needs the feature on ({DEFAULT_FLAG} or {LIMITS_FILE_FLAG})"
                )
        return None
    if min_pace is not None:
        section[MIN_PACE_KEY] = min_pace
    if burst is not None:
        section[BURST_KEY] = burst
    if input_token_weight is not None:
        section[INPUT_TOKEN_WEIGHT_KEY] = input_token_weight
    if max_users is not None:
        section[METRICS_MAX_USERS_KEY] = max_users
    if recompute_budget is not None:
        section[RECOMPUTE_BUDGET_KEY] = recompute_budget
    _warn_header_flag_in_body_mode(args, identity)
    install_middleware(args)
    return section


_FEATURE_ON = f"({DEFAULT_FLAG} or {LIMITS_FILE_FLAG})"


def _refuse_identity_flags_while_off(args: argparse.Namespace) -> None:
    # Identity is checked only while the feature is on: accepting these while
    # it is off would let an operator believe users are authenticated.
    if getattr(args, "output_rate_api_keys", None):
        raise OutputRateConfigError(f"{API_KEYS_FLAG} needs the feature on {_FEATURE_ON}")
    if (getattr(args, "output_rate_unknown_users", None) or "default") != "default":
        raise OutputRateConfigError(f"{UNKNOWN_USERS_FLAG} needs the feature on {_FEATURE_ON}")


def _warn_admin_flags_while_off(args: argparse.Namespace) -> None:
    # The route still answers (404: feature off) and still checks the key, so
    # the flag is harmless; say once that it guards nothing useful.
    for flag, given in (
        (ADMIN_KEY_FLAG, getattr(args, "output_rate_admin_key", None)),
        (ADMIN_KEY_FILE_FLAG, getattr(args, "output_rate_admin_key_file", None)),
        (ADMIN_OPEN_FLAG, getattr(args, "output_rate_admin_open", False)),
    ):
        if given:
            logger.warning(
                "vllm-output-rate: %s does nothing while the feature is off %s: "
                "the admin route answers 404", flag, _FEATURE_ON,
            )


def _warn_header_flag_in_body_mode(args: argparse.Namespace, identity: str) -> None:
    header = getattr(args, "output_rate_user_header", None)
    if identity == "body" and header and header.lower() != DEFAULT_USER_HEADER:
        logger.warning(
            "vllm-output-rate: %s does nothing in %s body mode: the user is "
            "vllm_xargs.output_rate_user", USER_HEADER_FLAG, IDENTITY_FLAG,
        )
