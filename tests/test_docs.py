"""The benchmark docs against their record: docs/benchmarks.md is what scripts/benchmark_table.py
writes from benchmarks/record.jsonl, short, and the README's figures for a comparison are the
table's; references to the benchmark docs' sections resolve. Fast: no Ray, no torch."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH_DOCS = ("benchmarks.md", "benchmark-runs.md", "benchmarks-earlier.md", "async-grpo-runs.md")


def _table():
    spec = importlib.util.spec_from_file_location("benchmark_table", ROOT / "scripts" / "benchmark_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_page_is_the_record_written_out():
    table = _table()
    runs = table.read_record()
    assert (DOCS / "benchmarks.md").read_text() == table.render(runs), \
        "docs/benchmarks.md differs from the record: run python scripts/benchmark_table.py"
    assert table.main(["--check"]) == 0


def test_page_is_short():
    assert len((DOCS / "benchmarks.md").read_text().splitlines()) <= 150


def test_every_comparison_has_a_latest_figure_and_command():
    table = _table()
    last = table.latest(table.read_record())
    assert len(last) >= 20
    page = (DOCS / "benchmarks.md").read_text()
    for comparison, run in last.items():
        assert run["command"], comparison
        assert f"`{comparison}`" in page  # one table row each
        assert table.figure_text(run["figures"][0]) in page


def test_record_is_checked(tmp_path):
    table = _table()
    good = table.read_record()[-1]
    path = tmp_path / "record.jsonl"
    for bad, message in [({**good, "date": "29.11.2026"}, "date"),
                         ({k: v for k, v in good.items() if k != "load"}, "keys"),
                         ({**good, "figures": [{**good["figures"][0], "low": 2.0, "high": 1.0}]}, "low above high"),
                         ({**good, "figures": []}, "figures")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=message):
            table.read_record(path)
    # a comparison's dates may not go back: its last line is its latest run
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "date": "2026-01-01"}) + "\n")
    with pytest.raises(ValueError, match="before"):
        table.read_record(path)


def test_readme_figures_are_the_tables():
    table = _table()
    last = table.latest(table.read_record())
    readme = (ROOT / "README.md").read_text()
    assert table.readme_mismatches(readme, last) == []
    # the README does quote the table: at least the asynchronous PPO figure
    assert "embodied_vs_sb3/HalfCheetah-v5/async" in readme


def test_readme_check_catches_a_stale_or_untied_figure():
    table = _table()
    last = table.latest(table.read_record())
    value = last["embodied_vs_sb3/HalfCheetah-v5/async"]["figures"][0]["value"]
    tied = f"# ({value}x the on-policy run's env steps/s, docs/benchmarks.md, embodied_vs_sb3/HalfCheetah-v5/async)"
    assert table.readme_mismatches(tied, last) == []
    wrapped = f"# ({value}x the on-policy run's env steps/s:\n#  docs/benchmarks.md, embodied_vs_sb3/HalfCheetah-v5/async)"
    assert table.readme_mismatches(wrapped, last) == []
    stale = tied.replace(f"{value}x", "1.75x")
    assert table.readme_mismatches(stale, last) == [
        "README.md:1: 1.75x is not among the latest figures of embodied_vs_sb3/HalfCheetah-v5/async"]
    assert len(table.readme_mismatches(wrapped.replace(f"{value}x", "1.75x"), last)) == 1
    assert len(table.readme_mismatches("# (1.34-1.99x on one H100, docs/benchmarks.md, "
                                       "async_grpo/SmolLM2-135M/pairs)", last)) == 1  # the range's end
    untied = "# (1.55x the on-policy run's env steps/s, docs/benchmarks.md)"
    assert "names no comparison id" in table.readme_mismatches(untied, last)[0]
    # a longer id is not its prefix's: planner/embodied/ahead's figures are not planner/embodied's
    assert table.readme_mismatches("# 0.99x (docs/benchmarks.md, planner/embodied/ahead)", last) == []


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _sections(text: str) -> list[str]:
    """Headings outside code blocks, and the bold leads that open paragraphs."""
    out, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and re.match(r"#{1,6} ", line):
            out.append(re.sub(r"^#+ ", "", line).strip())
        elif not code and line.startswith("**"):
            out.append(line[2:].split("**")[0])
    return out


def test_references_to_the_benchmark_docs_resolve():
    """`docs/X.md, "Section"` names a heading (or bold lead) of X; `X.md#anchor` a heading."""
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "scripts").glob("*"))]
    sections = {name: _sections((DOCS / name).read_text()) for name in BENCH_DOCS}
    quoted = re.compile(r"docs/(" + "|".join(map(re.escape, BENCH_DOCS)) + r"),\s+\"([^\"]+)\"")
    anchored = re.compile(r"\]\(((?:docs/)?[\w.-]*)#([\w-]+)\)")
    missing = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        for m in quoted.finditer(re.sub(r"\s+", " ", text)):
            if not any(s.startswith(m.group(2)) for s in sections[m.group(1)]):
                missing.append(f"{path.name}: {m.group(0)}")
        for m in anchored.finditer(text):
            target = Path(m.group(1)).name or path.name
            if target in BENCH_DOCS and m.group(2) not in {_slug(s) for s in sections[target]}:
                missing.append(f"{path.name}: {m.group(0)}")
    assert missing == []
