"""Configuration of the shared quota store: flags, the ``store`` section, validation.

``vllm serve`` flags (added by :func:`add_store_args`, folded into
``additional_config["output_rate"]["store"]`` by :func:`merge_store_args`)::

    --output-rate-store redis://HOST:PORT/DB     (also rediss://, unix://)
    --output-rate-store redis+cluster://HOST:PORT[,HOST:PORT...]
                                                 (a Redis Cluster; rediss+cluster://)
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

``redis+cluster://`` (or ``rediss+cluster://`` with TLS) names a Redis
Cluster (Redis >= 7.0 or Valkey): one or more seed nodes, comma-separated;
the client learns the other nodes from them.  A cluster has database 0 only,
so the path is empty, ``/`` or ``/0``.

The process that parses the flag checks the store once before any engine
starts (:func:`.redis_store.check_store_at_startup`, called from the
adapter's merge of the flags): what the engines could never use stops
startup with one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from vllm_output_rate.stores.backend import FALLBACKS

STORE_KEY = "store"
STORE_FLAG = "--output-rate-store"
FALLBACK_FLAG = "--output-rate-store-fallback"
ENGINES_FLAG = "--output-rate-expected-engines"
PREFIX_FLAG = "--output-rate-store-prefix"
PASSWORD_ENV = "OUTPUT_RATE_STORE_PASSWORD"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
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


def _schemes_text() -> str:
    return " / ".join(s + "://" for s in SCHEMES)


def split_userinfo(url: str) -> tuple[str | None, str | None, str]:
    """``(user, password, url without them)``; both decoded (%xx), None when absent.

    Works on every scheme here, including the comma-separated host list of a
    cluster URL (which ``urlsplit(...).port`` refuses).
    """
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at:
        return None, None, url
    user, colon, password = userinfo.partition(":")
    stripped = urlunsplit((parts.scheme, hosts, parts.path, parts.query, parts.fragment))
    return (unquote(user) or None), (unquote(password) if colon and password else None), stripped


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a ``redis+cluster://`` URL; ValueError names the problem."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a cluster URL ({' / '.join(s + '://' for s in CLUSTER_SCHEMES)})")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has database 0 only: use no path or /0")
    hosts = parts.netloc.rpartition("@")[2]
    nodes = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"cluster URL names a node without a host: {item!r}")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            raise ValueError(f"bad port in cluster node {item!r}") from None
        if not 0 < port < 65536:
            raise ValueError(f"bad port in cluster node {item!r}")
        nodes.append((host, port))
    return nodes


def _check_url(url: Any) -> str:
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"url must be a {_schemes_text()} URL")
    if urlsplit(url).scheme in CLUSTER_SCHEMES:
        cluster_nodes(url)
    return url


def parse_store_section(section: Any) -> StoreSettings | None:
    """The ``store`` section as :class:`StoreSettings`; ValueError names the problem."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"must be an object, got {type(section).__name__}")
    unknown = sorted(set(section) - {"url", "fallback", "expected_engines", "prefix"}, key=repr)
    if unknown:
        raise ValueError(f"unknown keys {unknown}")
    url = _check_url(section.get("url"))
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
    try:
        _check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    user, password, stripped = split_userinfo(text)
    if password:
        # The URL's password wins over one already in the environment (the
        # documented order: the URL's, else the variable's).
        os.environ[PASSWORD_ENV] = password
        if user:  # keep the user name (ACL user), drop only the password
            parts = urlsplit(stripped)
            text = urlunsplit(
                (parts.scheme, f"{quote(user, safe='')}@{parts.netloc}", parts.path, parts.query, parts.fragment)
            )
        else:
            text = stripped
    return text


def int_arg(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (0 or 1)."""
    kind = "non-negative" if minimum == 0 else "positive"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {kind} integer, got {text!r}")
        return value

    return parse


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
        "of the deployment; redis+cluster://HOST:PORT[,HOST:PORT...] (or "
        "rediss+cluster://) for a Redis Cluster (Redis >= 7 / Valkey; one script "
        "call per node per round trip). Password in the URL or in $" + PASSWORD_ENV
        + "; never logged. Checked once at startup: a refused password, an unknown "
        "host, TLS on one side only or the wrong cluster mode stops startup; a store "
        "that does not answer yet only delays sharing (the fallback applies). "
        "Without it each engine keeps its own quota.",
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
        type=int_arg(1),
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


def merge_store_args(
    args: argparse.Namespace, section: dict[str, Any] | None
) -> dict[str, Any] | None:
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
