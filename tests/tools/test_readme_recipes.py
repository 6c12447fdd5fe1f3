"""README's recipes go through the plugin's own parsers, and README stays short.

Each recipe in README.md is a fenced block after a marker line
``<!-- recipe: NAME -->`` (a recipe may have several blocks: a limits file and
the command that uses it).  A ``yaml`` block is a limits file and goes through
``settings.load_limits_file``, the loader the engine uses; a ``bash`` block's
``serve`` command goes through the rate-flag pre-check of ``vllm-output-rate
serve`` and then through vLLM's own ``serve`` parser with the plugin installed,
up to the ``additional_config`` the engine would get (the store is not
contacted); a ``pip install`` line must name extras that exist.  A recipe the
parsers refuse fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vllm_output_rate.settings import CONFIG_KEY, OutputRateSettings, load_limits_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300

#: The recipes README promises (issue 34): names of their markers.
RECIPES = ("cap-one-user", "team-rate-ceil-weight", "group-with-prompt-cost", "replicas-one-redis")

_BLOCK = re.compile(r"<!-- recipe: ([a-z0-9-]+) -->\s*\n```(\w+)\n(.*?)\n```", re.S)


def recipes(text: str) -> dict[str, list[tuple[str, str]]]:
    """{name: [(language, body), ...]} in README order."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name, language, body in _BLOCK.findall(text):
        found.setdefault(name, []).append((language, body))
    return found


def commands(body: str) -> list[list[str]]:
    """A shell block's commands as argv lists (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", body)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


README_TEXT = README.read_text()
RECIPE_BLOCKS = recipes(README_TEXT)


@pytest.fixture(scope="module")
def plugin():
    """vLLM with the plugin's patches installed (what vLLM's plugin loader does)."""
    import vllm_output_rate

    vllm_output_rate.register()
    from vllm_output_rate.adapter import patches

    return patches


@pytest.fixture()
def serve_parser(plugin, monkeypatch):
    """The parser of ``vllm serve`` (frontend and engine flags, the plugin's groups)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.adapter import compat

    # Creating an engine config flips a process-global; keep other tests unaffected.
    monkeypatch.setattr(plugin, "_frontend_active", plugin._frontend_active)
    return compat.installed_series().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def test_readme_stays_within_its_length():
    lines = README_TEXT.count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move what is not for the "
        "operator to docs/, do not compress sentences")


def test_every_promised_recipe_is_there():
    assert set(RECIPE_BLOCKS) == set(RECIPES), sorted(RECIPE_BLOCKS)


def test_the_extractor_finds_what_a_marker_precedes():
    text = "x\n<!-- recipe: a -->\n```yaml\nk: 1\n```\n\n<!-- recipe: a -->\n```bash\nrun \\\n  --x 1\n```\n"
    assert recipes(text) == {"a": [("yaml", "k: 1"), ("bash", "run \\\n  --x 1")]}
    assert commands("run \\\n  --x '{\"a\": 1}'  # note") == [["run", "--x", '{"a": 1}']]


def _limits_files(name: str, tmp_path: Path) -> dict[str, str]:
    """The recipe's YAML blocks, loaded by the engine's loader and kept on disk
    under the name the recipe's command uses (``limits.yaml``)."""
    files = {}
    for language, body in RECIPE_BLOCKS[name]:
        if language == "yaml":
            path = tmp_path / "limits.yaml"
            path.write_text(body + "\n")
            load_limits_file(str(path))  # raises OutputRateConfigError on a refused file
            files["limits.yaml"] = str(path)
    return files


def _extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


def _check_serve(argv: list[str], files: dict[str, str], parser, tiny_model_dir: str, monkeypatch) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_output_rate.adapter import patches
    from vllm_output_rate.tools import cli

    assert argv[:2] in (["vllm-output-rate", "serve"], ["vllm", "serve"]), argv
    assert argv[2] == "MODEL", argv
    args = [files.get(arg, arg) for arg in argv[3:]]
    cli._precheck_rate_flags(args)  # SystemExit with the one-line error on a refused value
    contacted = []
    monkeypatch.setattr(patches, "check_store_at_startup", lambda url, **kw: contacted.append(url))
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", tiny_model_dir, *args]))
    section = engine_args.additional_config[CONFIG_KEY]
    settings = OutputRateSettings.from_additional_config(engine_args.additional_config)
    assert settings is not None
    return {"section": section, "settings": settings, "store_checked": contacted}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_accepted_by_the_parsers(name, tmp_path, serve_parser, tiny_model_dir, monkeypatch):
    blocks = RECIPE_BLOCKS[name]
    assert blocks, name
    files = _limits_files(name, tmp_path)
    served = []
    for language, body in blocks:
        assert language in ("yaml", "bash"), (name, language)
        if language != "bash":
            continue
        for argv in commands(body):
            if argv[:2] == ["pip", "install"]:
                for spec in argv[2:]:
                    extras = re.findall(r"\[([^\]]+)\]", spec)
                    for extra in (e.strip() for group in extras for e in group.split(",")):
                        assert extra in _extras(), f"{name}: no extra [{extra}] in pyproject.toml"
                continue
            served.append(_check_serve(argv, files, serve_parser, tiny_model_dir, monkeypatch))
    if name == "replicas-one-redis":
        (result,) = served
        assert result["settings"].store is not None and result["store_checked"], result
        assert result["settings"].store.expected_engines == 4
        assert any("[redis]" in body for _, body in blocks)
    if name == "group-with-prompt-cost":
        (result,) = served
        assert result["section"]["limits_file"].endswith("limits.yaml")
        limits = load_limits_file(files["limits.yaml"])
        assert limits.input_token_weight > 0 and limits.group_rates


def _flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))


#: Flags README names that belong to other commands than ``serve``.
NOT_SERVE_FLAGS = {"--once", "--url", "--interval"}


def test_every_flag_readme_names_exists(serve_parser):
    known = set(serve_parser._option_string_actions)
    unknown = sorted(_flags_in(README_TEXT) - known - NOT_SERVE_FLAGS)
    assert not unknown, f"README names flags that vllm serve does not have: {unknown}"
