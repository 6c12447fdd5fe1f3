"""The record: every committed figure under docs/ comes from its committed JSON.

Each PNG carries the sha256 of the JSON it was drawn from (or, for the demos,
written with) in a PNG text chunk (``render.DIGEST_KEY``).  ``make performance``
draws the benchmarks' figures again from docs/benchmarks/*.json, so a stale
figure here means: run ``make performance`` (or re-run the benchmark) and
commit the PNG with its JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_output_rate.tools.render import (
    DIGEST_KEY,
    figure_metadata,
    json_digest,
    png_text,
    record_mismatch,
    sibling_json,
    stamp_png,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "benchmarks"
FIGURES = sorted(DOCS.glob("*.png")) + sorted(RESULTS.glob("*.png"))


def source_of(png: Path) -> Path:
    """docs/NAME.png and docs/benchmarks/NAME.png both belong to docs/benchmarks/NAME.json."""
    return RESULTS / f"{png.stem}.json"


def test_there_are_committed_figures():
    assert FIGURES, "no PNG under docs/"


@pytest.mark.parametrize("png", FIGURES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_figure_carries_the_digest_of_its_json(png):
    why = record_mismatch(png, source_of(png))
    assert why is None, f"{why}; run `make performance` (or the benchmark) and commit both files"


def _figure(path: Path, source: Path | None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5), dpi=50)
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([0, 1], [1, 0])
    fig.savefig(path, metadata=figure_metadata(source))


def test_a_figure_fails_once_its_json_changes(tmp_path):
    source = tmp_path / "bench.json"
    source.write_text(json.dumps({"tok_s": 309}) + "\n")
    png = tmp_path / "bench.png"
    _figure(png, sibling_json(png))
    assert png_text(png)[DIGEST_KEY] == json_digest(source)
    assert record_mismatch(png, source) is None
    source.write_text(json.dumps({"tok_s": 428}) + "\n")  # a later run, the figure not redrawn
    assert "another version of bench.json" in record_mismatch(png, source)


def test_a_figure_without_a_digest_or_a_json_fails(tmp_path):
    source = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    _figure(png, None)
    assert "no " in record_mismatch(png, source)
    source.write_text("{}\n")
    assert "carries no digest" in record_mismatch(png, source)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    assert "not a PNG" in record_mismatch(tmp_path / "broken.png", source)


def test_stamping_keeps_the_image_and_replaces_an_old_digest(tmp_path):
    from PIL import Image

    source = tmp_path / "demo.json"
    source.write_text("{}\n")
    png = tmp_path / "demo.png"
    _figure(png, None)
    before = Image.open(png).convert("RGBA").tobytes()
    stamp_png(png, {DIGEST_KEY: "0" * 64})
    stamp_png(png, figure_metadata(source))
    assert record_mismatch(png, source) is None
    assert png.read_bytes().count(DIGEST_KEY.encode()) == 1
    image = Image.open(png)
    image.load()  # CRCs checked
    assert image.convert("RGBA").tobytes() == before
