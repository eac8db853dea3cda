"""The docs: README.md stays a front door, every relative link resolves, benchmarks.md is generated.

``docs/benchmarks.md`` and the generated section of ``docs/simulator.md`` must
equal what ``gradsync bench report`` renders from the committed
``docs/bench/*.json`` (so their numbers come from ``make bench``, never from a
paste); after changing a bench's table formatting, run ``gradsync bench
report`` and commit the pages.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from gradsync.bench import report

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _pages() -> list[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(heading) for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))}


def _links(path: Path) -> list[str]:
    return _LINK.findall(_prose(path.read_text(encoding="utf-8")))


def test_readme_is_a_front_door():
    """README.md is at most 250 lines and keeps the commands a new user runs (the slow tests' one too)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md has {len(text.splitlines())} lines"
    assert "make demo" in text and "make test" in text and "make test-slow" in text


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    """Every relative link (and its #anchor, for markdown targets) points at a file of the repository."""
    problems = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if ROOT not in resolved.parents and resolved != ROOT:
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            problems.append(f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_docs_cite_nothing_outside_the_repository():
    """No page, module or test points at the team's shared files or absolute paths of a machine."""
    code = [path for folder in ("src", "tests", "tools") for path in sorted((ROOT / folder).rglob("*.py"))
            if path.name != "test_docs.py"]
    for page in [*_pages(), *code]:
        text = page.read_text(encoding="utf-8")
        for needle in ("DESIGN.md", "STYLE.md", "/work/", "/tmp/gs", "shared files"):
            assert needle not in text, f"{page.relative_to(ROOT)} mentions {needle!r}"


def test_benchmarks_md_is_the_rendering_of_the_committed_json():
    """docs/benchmarks.md == gradsync bench report's rendering of docs/bench/*.json (regenerate, never paste)."""
    committed = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == report.render(DOCS / "bench"), (
        "docs/benchmarks.md differs from the rendering of docs/bench/*.json: run `gradsync bench report` "
        "(or `make bench` to measure again) and commit both")


def test_simulator_md_figures_are_the_rendering_of_the_committed_json():
    """docs/simulator.md's generated section == the rendering of docs/bench/sim_*.json (regenerate, never paste)."""
    page = (DOCS / "simulator.md").read_text(encoding="utf-8")
    assert page == report.splice_simulator_page(page, DOCS / "bench", "docs/simulator.md"), (
        "docs/simulator.md's generated section differs from the rendering of docs/bench/sim_*.json: run "
        "`gradsync bench report` (or `make bench` to measure again) and commit both")


def test_committed_bench_json_carries_its_metadata():
    """Every committed bench file says when, where, under which load and with which command it was measured."""
    documents = report.load(DOCS / "bench")
    assert set(documents) == set(report.BENCHES), f"missing: {set(report.BENCHES) - set(documents)}"
    for name, document in documents.items():
        assert document["bench"] == name, name
        assert (document["command"] + " ").startswith(f"gradsync {' '.join(report.command_of(name))} "), name
        assert document["rows"], name
        assert {"platform", "cpu_model", "cpu_count", "memory_gib"} <= set(document["machine"]), name
        assert len(document["load_before"]) == 3 and len(document["load_after"]) == 3, name
        assert {"gradsync", "torch"} <= set(document["versions"]) and document["date"].endswith("Z"), name


_FAKE_ROW = {"algorithm": "ring", "world_size": 2, "nbytes": 4096, "time_us": 100.0, "algbw_gbps": 0.04,
             "busbw_gbps": 0.04, "ratio_to_native": 1.0, "bytes_sent_per_call": 4096.0, "repetitions": 1,
             "iterations": 1, "run_folder": "/somewhere/temporary"}


def test_record_wraps_the_rows_with_metadata_and_render_uses_the_bench_formatter(tmp_path):
    """record runs `gradsync bench NAME --json F` (here a stand-in) and wraps F's rows; render shows them."""
    from gradsync.bench.record import record
    from gradsync.cli import build_parser

    calls = []

    def fake_main(argv):
        calls.append(argv)
        path = argv[argv.index("--json") + 1]
        Path(path).write_text(json.dumps([_FAKE_ROW]))
        return 0

    cli = {"parse": build_parser().parse_args, "run": fake_main}
    path = record("allreduce", ["--nproc", "2", "--sizes", "4K"], tmp_path, **cli)
    assert calls and calls[0][:6] == ["bench", "allreduce", "--nproc", "2", "--sizes", "4K"]
    document = json.loads(path.read_text())
    assert document["command"] == "gradsync bench allreduce --nproc 2 --sizes 4K"
    assert document["options"]["nproc"] == 2 and document["options"]["repeat"] == 5  # defaults recorded
    assert "run_folder" not in document["rows"][0]
    page = report.render(tmp_path)
    from gradsync.bench.allreduce import format_table
    assert format_table([{k: v for k, v in _FAKE_ROW.items() if k != "run_folder"}]) in page
    assert document["date"] in page and "Not measured yet" in page  # the other benches
    with pytest.raises(ValueError, match="--json"):
        record("allreduce", ["--json", "x.json"], tmp_path, **cli)
    path = record("allreduce_hosts_1g", ["--hosts", "2", "--nproc", "2"], tmp_path, **cli)
    assert calls[-1][:2] == ["bench", "allreduce"]  # a record name "<bench>_<label>" runs <bench>
    document = json.loads(path.read_text())
    assert path.name == "allreduce_hosts_1g.json" and document["bench"] == "allreduce_hosts_1g"
    assert document["command"] == "gradsync bench allreduce --hosts 2 --nproc 2"
    assert document["options"]["hosts"] == 2


def test_the_add_an_algorithm_example_runs_as_a_registered_algorithm(monkeypatch):
    """The sketch in docs/architecture.md, registered with one line, sums like the reference on 3 thread ranks."""
    import torch

    import gradsync
    from gradsync.collectives import check, ops, registry
    from _dist import run_threads

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Adding an AllReduce algorithm"):text.index("## Adding a compressor")]
    source = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("simple_ring")
    monkeypatch.setitem(sys.modules, "simple_ring", module)  # dataclasses look their module up
    exec(compile(source, "docs/architecture.md", "exec"), module.__dict__)  # noqa: S102 - our own doc
    monkeypatch.setitem(registry.ALL_REDUCE, "simple_ring", module.all_reduce)
    algorithms = tuple(registry.ALL_REDUCE) + (registry.AUTO,)  # what the registry computes at import
    for module_reading_it in (registry, ops, check):
        monkeypatch.setattr(module_reading_it, "ALGORITHMS", algorithms)
    world_size, numel = 3, 10

    def rank_fn(comm):
        tensor = torch.arange(numel, dtype=torch.float64) * (comm.rank + 1)
        return gradsync.collectives.all_reduce(tensor, comm, algorithm="simple_ring")

    results = run_threads(world_size, rank_fn)
    expected = torch.arange(numel, dtype=torch.float64) * sum(range(1, world_size + 1))
    assert all(torch.equal(result, expected) for result in results)


@pytest.mark.parametrize("content, needle", [("{not json", "not JSON"), ('{"rows": []}', "no command")])
def test_report_names_a_file_that_is_not_a_benchmark_record(tmp_path, content, needle):
    """A damaged docs/bench file is a one-line ValueError naming it, not a traceback."""
    (tmp_path / "allreduce.json").write_text(content)
    with pytest.raises(ValueError, match=f"allreduce.json .*{needle}"):
        report.render(tmp_path)


def test_report_and_record_name_a_folder_they_cannot_write(tmp_path):
    from gradsync.bench.record import record
    from gradsync.cli import build_parser

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--out .*cannot be written"):
        report.write(tmp_path, blocker / "benchmarks.md")
    with pytest.raises(ValueError, match="--bench-dir .*cannot be created"):
        record("allreduce", [], blocker / "bench", parse=build_parser().parse_args, run=lambda argv: 0)
