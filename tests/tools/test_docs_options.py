"""README.md and docs/operations.md name the plugin's options exactly as the code parses them.

Issue 46: the docs said "exactly four" limits-file keys while the loader took
five, listed no per-user ``min_stream_tokens_per_second``, and gave the
recompute budget a different unit than ``--help``.  This test reads both
documents and holds them to the parsers:

* every ``--flag`` either document names is an option of vLLM's ``serve``
  parser with the plugin installed, or of a ``vllm-output-rate`` tool;
* every option the plugin adds to ``serve`` (``patches.add_output_rate_args``,
  which includes ``options.add_operate_args`` and the store flags) has a row in
  a flag table (a table whose first header cell is ``flag``), and that row's
  default is the one the code applies;
* the ``additional_config`` keys of the flag tables are the keys
  ``OutputRateSettings`` accepts (``store.*``: the store section's);
* the limits-file table of docs/operations.md lists exactly the keys
  ``settings.load_limits_file`` accepts, and names every key of a user's limit;
* every environment variable the plugin reads is named, and every
  ``$VLLM_OUTPUT_RATE_*`` / ``$OUTPUT_RATE_*`` named is one it reads.

A failure names the option and says where it should be written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

from vllm_output_rate import settings
from vllm_output_rate.adapter import admin, patches, worker_idle
from vllm_output_rate.policy.eviction import DEFAULT_RECOMPUTE_RATIO
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.stores import config as store_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/operations.md")}
WHERE_TO_WRITE = "add a row to the flag table of README.md (flag | additional_config key | default | meaning)"

#: A flag as written in prose or a table: two dashes, lower-case words joined by dashes.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
ENV = re.compile(r"\$((?:VLLM_)?OUTPUT_RATE_[A-Z0-9_]+)")
#: What a document writes for "no default: off".
OFF = {"off", "–", "-", "none"}

#: The default the code applies when the parser's own default is None (the
#: setting's default lives in the settings / policy, where the engine reads it).
EFFECTIVE_DEFAULTS = {
    "output_rate_metrics_max_users": settings.DEFAULT_METRICS_MAX_USERS,
    "output_rate_recompute_budget": DEFAULT_RECOMPUTE_RATIO,
    "output_rate_burst_seconds": settings.DEFAULT_BURST_SECONDS,
    "output_rate_min_stream_tokens_per_second": DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
    "output_rate_input_token_weight": settings.OutputRateSettings.__dataclass_fields__[
        "input_token_weight"].default,
    "output_rate_store_fallback": store_config.StoreSettings.__dataclass_fields__["fallback"].default,
    "output_rate_expected_engines": store_config.StoreSettings.__dataclass_fields__[
        "expected_engines"].default,
    "output_rate_store_prefix": store_config.DEFAULT_PREFIX,
    # Shadow mode (adapter/shadow.py): the limits hold unless told otherwise.
    "output_rate_mode": getattr(settings, "ENFORCE", None),
}

#: Environment variables the plugin reads (not the tools').
PLUGIN_ENV = {store_config.PASSWORD_ENV, worker_idle.SPIN_WINDOW_ENV, admin.ADMIN_KEY_ENV}

#: The tools whose flags the documents may name (``vllm-output-rate COMMAND --flag``).
TOOLS = ("bench", "top", "demo", "demo-cluster")


def plugin_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    patches.add_output_rate_args(parser)
    return parser


def plugin_options() -> dict[str, argparse.Action]:
    return {
        option: action
        for action in plugin_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def tables(text: str, first_header: str) -> list[list[list[str]]]:
    """Markdown tables whose first header cell is ``first_header``: rows of cells, header dropped."""
    found, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if current is None:
            current = [] if cells[0].strip("`") == first_header else False
            if current is not False:
                found.append(current)
            continue
        if current is False or set(cells[0]) <= set("-: "):
            continue
        current.append(cells)
    return found


def flag_rows() -> list[tuple[str, list[str]]]:
    return [(name, row) for name, text in DOCS.items() for table in tables(text, "flag") for row in table]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    """Every option of vLLM's ``serve`` with the plugin, and of the documented tools."""
    import vllm_output_rate

    vllm_output_rate.register()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.adapter import compat
    from vllm_output_rate.tools import cli

    frontend = patches._frontend_active
    try:
        serve = compat.installed_series().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    finally:
        patches._frontend_active = frontend
    known = {option for action in serve._actions for option in action.option_strings}
    for tool in TOOLS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            cli.main([tool, "--help"])
        known |= set(FLAG.findall(out.getvalue()))
    return known


def test_every_flag_the_docs_name_is_parsed(known_flags):
    unknown = []
    for name, text in DOCS.items():
        for number, line in enumerate(text.splitlines(), 1):
            unknown += [f"{name}:{number}: {flag}" for flag in FLAG.findall(line) if flag not in known_flags]
    assert not unknown, (
        "the docs name flags that neither vLLM's serve parser (with the plugin) nor a "
        f"vllm-output-rate tool ({', '.join(TOOLS)}) knows:\n  " + "\n  ".join(unknown))


def test_every_plugin_option_has_a_row_in_a_flag_table():
    documented = {flag for _, row in flag_rows() for flag in FLAG.findall(row[0])}
    missing = sorted(set(plugin_options()) - documented)
    assert not missing, (
        "options of the plugin's serve parser (patches.add_output_rate_args) that no flag "
        f"table of README.md or docs/operations.md names: {missing}; {WHERE_TO_WRITE}")


def _default_text(cell: str) -> str:
    text = cell.replace("`", "").strip()
    return text.split(" (")[0].split(";")[0].strip()


def _expected_default(action: argparse.Action):
    if action.default is None or action.default is False:
        return EFFECTIVE_DEFAULTS.get(action.dest)
    return action.default


@pytest.mark.parametrize("option", sorted(plugin_options()))
def test_each_documented_default_is_the_codes(option):
    action = plugin_options()[option]
    rows = [(name, row) for name, row in flag_rows() if option in FLAG.findall(row[0])[:1]]
    if not rows:
        pytest.fail(f"{option} has no row in a flag table; {WHERE_TO_WRITE}")
    expected = _expected_default(action)
    for name, row in rows:
        assert len(row) >= 3, f"{name}: the row of {option} has no default column: {row}"
        written = _default_text(row[2])
        where = f"{name}, row of {option}: default written {row[2]!r}"
        if expected is None:
            assert written.lower() in OFF, f"{where}; the code has none (write 'off' or '–')"
        elif isinstance(expected, (int, float)) and not isinstance(expected, bool):
            try:
                assert float(written) == float(expected), f"{where}; the code's is {expected!r}"
            except ValueError:
                pytest.fail(f"{where}; the code's is {expected!r}")
        else:
            assert written == str(expected), f"{where}; the code's is {expected!r}"


def test_the_additional_config_keys_are_the_settings():
    section_keys = set(settings._SECTION_KEYS)
    store_keys = {f.name for f in dataclasses.fields(store_config.StoreSettings)}
    named: set[str] = set()
    unknown = []
    for name, row in flag_rows():
        if len(row) < 2:
            continue
        for key in backticked(row[1]):
            named.add(key)
            top, _, sub = key.partition(".")
            if top not in section_keys or (sub and (top != settings.STORE_KEY or sub not in store_keys)):
                unknown.append(f"{name}: {key}")
    assert not unknown, f"keys the flag tables name that additional_config['output_rate'] refuses: {unknown}"
    expected = (section_keys - {settings.STORE_KEY}) | {f"{settings.STORE_KEY}.{k}" for k in store_keys}
    missing = sorted(expected - named)
    assert not missing, (
        f"additional_config['output_rate'] keys no flag table names: {missing}; write each in "
        "the key column of its flag's row in README.md")


def test_the_limits_file_table_lists_exactly_the_loaders_keys():
    found = tables(DOCS["docs/operations.md"], "key")
    assert found, "docs/operations.md has no limits-file table (first header cell 'key')"
    rows = found[0]
    written = [backticked(row[0])[0] for row in rows if backticked(row[0])]
    accepted = set(settings.LIMITS_FILE_KEYS)
    assert not set(written) - accepted, (
        f"docs/operations.md's limits-file table names keys the loader refuses: {sorted(set(written) - accepted)}")
    assert not accepted - set(written), (
        "keys settings.load_limits_file accepts that docs/operations.md's limits-file table "
        f"does not list: {sorted(accepted - set(written))}; add a row (key | required | meaning)")
    user_row = " ".join(" ".join(row) for row in rows if backticked(row[0])[:1] == [settings.OVERRIDES_KEY])
    limit_keys = (*settings.LIMIT_KEYS, settings.GROUP_KEY, settings.MIN_PACE_KEY)
    missing = [key for key in limit_keys if key not in user_row]
    assert not missing, (
        f"the row of {settings.OVERRIDES_KEY} in docs/operations.md does not name the limit keys {missing}")


def test_every_environment_variable_the_plugin_reads_is_named():
    text = "\n".join(DOCS.values())
    named = set(ENV.findall(text))
    assert not named - PLUGIN_ENV, f"the docs name variables the plugin does not read: {sorted(named - PLUGIN_ENV)}"
    assert not PLUGIN_ENV - named, (
        f"variables the plugin reads that neither document names (as $NAME): {sorted(PLUGIN_ENV - named)}")


def test_the_table_parser_reads_a_table():
    """The helper above must see rows, or every check on them would pass vacuously."""
    assert len(flag_rows()) >= 15  # README's table has a row per flag
    assert tables("| flag | key |\n| --- | --- |\n| `--a` | `b` |\n", "flag") == [[["`--a`", "`b`"]]]
