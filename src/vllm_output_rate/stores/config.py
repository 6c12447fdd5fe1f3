"""Configuration of the shared quota store: flags, the ``store`` section, validation.

``vllm serve`` flags (added by :func:`add_store_args`, folded into
``additional_config["output_rate"]["store"]`` by :func:`merge_store_args`)::

    --output-rate-store redis://HOST:PORT/DB     (also rediss://, unix://)
    --output-rate-store-fallback {local,closed}  (default local)
    --output-rate-expected-engines N             (default 1)
    --output-rate-store-prefix PREFIX            (default vllm-output-rate)

Offline / ``additional_config`` form::

    {"output_rate": {"default_user_output_tokens_per_second": 30,
                     "store": {"url": "redis://127.0.0.1:6379/0",
                               "fallback": "local", "expected_engines": 2,
                               "prefix": "my-model"}}}

A password given in the flag's URL is taken out of the URL when the flag is
parsed and put into the environment variable ``OUTPUT_RATE_STORE_PASSWORD``
(inherited by vLLM's engine processes), so neither vLLM's "non-default args"
log line nor ``additional_config`` ever holds it.  No vLLM or redis import.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

STORE_KEY = "store"
STORE_FLAG = "--output-rate-store"
FALLBACK_FLAG = "--output-rate-store-fallback"
ENGINES_FLAG = "--output-rate-expected-engines"
PREFIX_FLAG = "--output-rate-store-prefix"
PASSWORD_ENV = "OUTPUT_RATE_STORE_PASSWORD"
SCHEMES = ("redis", "rediss", "unix")
FALLBACKS = ("local", "closed")
DEFAULT_PREFIX = "vllm-output-rate"


@dataclass(frozen=True)
class StoreSettings:
    """Where the shared quota lives and what to do without it."""

    url: str
    fallback: str = "local"
    expected_engines: int = 1
    prefix: str = DEFAULT_PREFIX

    def to_config(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "fallback": self.fallback,
            "expected_engines": self.expected_engines,
            "prefix": self.prefix,
        }


def parse_store_section(section: Any) -> StoreSettings | None:
    """The ``store`` section as :class:`StoreSettings`; ValueError names the problem."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"must be an object, got {type(section).__name__}")
    unknown = sorted(set(section) - {"url", "fallback", "expected_engines", "prefix"}, key=repr)
    if unknown:
        raise ValueError(f"unknown keys {unknown}")
    url = section.get("url")
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"url must be a {' / '.join(s + '://' for s in SCHEMES)} URL")
    fallback = section.get("fallback", "local")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
    engines = section.get("expected_engines", 1)
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ValueError(f"expected_engines must be a positive integer, got {engines!r}")
    prefix = section.get("prefix", DEFAULT_PREFIX)
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    return StoreSettings(url=url, fallback=fallback, expected_engines=engines, prefix=prefix)


# -- vllm serve flags ------------------------------------------------------------


def _store_url_arg(text: str) -> str:
    """Validate the URL; move a password out of it into the environment."""
    parts = urlsplit(text)
    if parts.scheme not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"must be a {' / '.join(s + '://' for s in SCHEMES)} URL"
        )
    if parts.password:
        os.environ.setdefault(PASSWORD_ENV, parts.password)
        user = f"{parts.username}@" if parts.username else ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        text = urlunsplit((parts.scheme, f"{user}{host}{port}", parts.path, parts.query, ""))
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_store_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        title="OutputRate shared quota",
        description="Share each user's quota across engines through Redis / Valkey "
        "(vllm-output-rate plugin; see its README, 'Scale-out').",
    )
    group.add_argument(
        STORE_FLAG,
        dest="output_rate_store",
        type=_store_url_arg,
        default=None,
        metavar="URL",
        help="redis://HOST:PORT/DB (or rediss://, unix://) shared by every engine "
        "of the deployment. Password in the URL or in $" + PASSWORD_ENV + "; never "
        "logged. Without it each engine keeps its own quota.",
    )
    group.add_argument(
        FALLBACK_FLAG,
        dest="output_rate_store_fallback",
        choices=FALLBACKS,
        default=None,
        help="While the store does not answer: local (default; each engine enforces "
        f"rate / {ENGINES_FLAG}) or closed (every limited user pauses).",
    )
    group.add_argument(
        ENGINES_FLAG,
        dest="output_rate_expected_engines",
        type=_positive_int,
        default=None,
        metavar="E",
        help="Engines sharing the store (default 1); the local fallback divides rates by it.",
    )
    group.add_argument(
        PREFIX_FLAG,
        dest="output_rate_store_prefix",
        default=None,
        metavar="PREFIX",
        help=f"Key prefix in the store (default {DEFAULT_PREFIX}); one per deployment.",
    )


def merge_store_args(args: argparse.Namespace, section: dict | None) -> dict | None:
    """Fold the store flags into the ``output_rate`` section (None: feature off)."""
    url = getattr(args, "output_rate_store", None)
    extra = {
        "fallback": getattr(args, "output_rate_store_fallback", None),
        "expected_engines": getattr(args, "output_rate_expected_engines", None),
        "prefix": getattr(args, "output_rate_store_prefix", None),
    }
    given = {k: v for k, v in extra.items() if v is not None}
    if url is None:
        if given:
            flags = {"fallback": FALLBACK_FLAG, "expected_engines": ENGINES_FLAG, "prefix": PREFIX_FLAG}
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{', '.join(flags[k] for k in given)} {verb} {STORE_FLAG}")
        return section
    if section is None:
        raise ValueError(f"{STORE_FLAG} needs the feature on (a default rate or a limits file)")
    store = {"url": url, **given}
    parse_store_section(store)  # same validation as additional_config
    section = dict(section)
    section[STORE_KEY] = store
    return section
