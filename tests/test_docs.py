"""The README and the manual under docs/: every link reaches a file and, with a #fragment, a heading
of it; every page of the manual is linked from the README's index; the README stays a door."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])

# Pages linked before they exist, each with the work that writes it; once the file is there its
# links are checked like any other (and this entry can go).
PENDING: dict[str, str] = {}  # a page a link may name before it is written: {path: why}

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links are links."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as '-'.

    >>> slug("Elastic runs: `scaling.min_nodes`")
    'elastic-runs-scalingmin_nodes'
    >>> slug("Elastic: node lost -> training again: `make bench-elastic`")
    'elastic-node-lost---training-again-make-bench-elastic'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")  # a link's text, code's text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page, repeated ones numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # https:, mailto: ... are not checked here


def broken(page: Path) -> list[str]:
    out = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        name = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if name not in PENDING:
                out.append(f"{target}: no file {name}")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{target}: {name} has no heading #{fragment}")
    return out


def test_the_pages_are_there():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/spec.md", "docs/faults.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_reaches_a_file_and_its_heading(page):
    assert broken(page) == []


def test_every_page_of_the_manual_is_in_the_readme_index():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    pages = [p for p in PAGES if p.parent.is_relative_to(ROOT / "docs")] + [ROOT / "CONTRIBUTING.md"]
    assert [p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked] == []


def test_the_readme_stays_a_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_checker_finds_a_broken_file_and_a_broken_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Its `part`\n\n[ok](#its-part) [ok](b.md#b) "
                                   "[no](c.md) [no](b.md#nope) `[code](x.md)`\n\n```\n[fenced](y.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken(tmp_path / "a.md") == ["c.md: no file c.md", "b.md#nope: b.md has no heading #nope"]


# --- command examples: every `raylaunch ...` (and `accelerate launch ...`) line of a fenced block parses -----------

_FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)
# raylaunch's own options that, written after a script, would reach the script instead (everything after it does)
_OURS_AFTER_SCRIPT = ("--follow", "--address", "--dry-run", "--local-nodes", "--storage", "--fresh", "--quiet")


def _commands(tool: str) -> list[tuple[str, str]]:
    """(where, command) for each line of a fenced block that starts with ``tool``: a line in two columns gives two,
    continuation lines are joined, ``[--x]`` (optional) reads as ``--x``, ``[X ...]`` is left out, and shell
    redirections and comments end it. Pictures (arrows) are not commands."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in _FENCED.finditer(text):
            first = text[:block.start(2)].count("\n") + 1
            lines = block.group(2).splitlines()
            i = 0
            while i < len(lines):
                line, at = lines[i].strip().removeprefix("$ "), first + i
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                i += 1
                if not line.startswith(tool + " ") or "──>" in line:
                    continue
                for part in re.split(r"\s{2,}(?=" + re.escape(tool) + " )", line):
                    part = re.sub(r"\[(-[^\]\s]+)\]", r"\1", part)
                    part = re.sub(r"\[[^\]]*\.\.\.\]", "", part)
                    part = re.split(r"\s[>|]\s|\s&&\s|\s#\s", part)[0]
                    out.append((f"{page.relative_to(ROOT)}:{at}", part))
    return out


def test_every_raylaunch_command_in_the_docs_parses_as_the_text_means():
    import shlex

    from jobs.cli import _parser
    from jobs.spec.launch import is_script_command, parse

    commands = _commands("raylaunch")
    assert len(commands) > 30
    wrong = []
    for where, line in commands:
        argv = shlex.split(line)[1:]
        try:
            if argv[0] == "launch" or (argv[0] in ("submit", "validate") and is_script_command(argv[1:])):
                cmd = parse(argv[0], argv[1:])
                given = [a for a in cmd.raw["args"] if a.split("=")[0] in _OURS_AFTER_SCRIPT]
                if given:
                    wrong.append(f"{where}: {line}\n  {', '.join(given)} comes after the script, so the script "
                                 "gets it; put raylaunch's options before the script")
            else:
                _parser().parse_args(argv)
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - argparse exits; the spec layer raises
            wrong.append(f"{where}: {line}\n  does not parse: {exc}")
    assert not wrong, "\n".join(wrong)


def test_the_submit_that_follows_follows():
    from jobs.spec.launch import parse

    for where, line in _commands("raylaunch"):
        if line.startswith("raylaunch submit") and "--follow" in line and ".py" in line:
            import shlex

            cmd = parse("submit", shlex.split(line)[2:])
            assert cmd.options.follow is True, where


def test_every_accelerate_launch_command_in_the_docs_parses_with_accelerates_parser():
    import shlex

    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    commands = _commands("accelerate launch") + [(w, c.split("  ")[0]) for w, c in _commands("ACCELERATE_USE_CPU=true")]
    wrong = []
    for where, line in commands:
        argv = shlex.split(line)
        argv = argv[argv.index("launch") + 1:]
        try:
            args = parser.parse_args(argv)
            assert args.training_script, "no script"
        except (SystemExit, AssertionError) as exc:
            wrong.append(f"{where}: {line}: {exc}")
    assert not wrong, "\n".join(wrong)


# --- figures carry their source: every number of the README's benchmark table is in the file its row comes from ---

README_TABLE_SOURCES = {  # a row's first cell, as it starts -> where its figures are
    "command -> first step": "bench/results.md",
    "steady step": "bench/results.md",
    "rank killed": "bench/results.md",
    "CPU beside the ranks": "bench/results.md",
    "node lost": "bench/results-elastic.md",
    "the driver at 1,024 ranks": "bench/results-scale.md",
    "a save of 576 MiB": "docs/benchmarks.md",
    "a script that finished": "bench/results-exits.md",
}


def test_every_figure_of_the_readmes_benchmark_table_is_in_the_results_it_comes_from():
    text = (ROOT / "README.md").read_text()
    table = text.split("## Benchmarks, in one table", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in ("|" + table).splitlines() if r.startswith("| ") and not r.startswith("| |")]
    assert len(rows) >= 7
    missing = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        source = next((f for label, f in README_TABLE_SOURCES.items() if cells[0].startswith(label)), None)
        assert source is not None, f"README benchmark row without a source: {cells[0]!r} (add it to README_TABLE_SOURCES)"
        results = (ROOT / source).read_text().replace(",", "")
        for figure in re.findall(r"\d[\d,]*\.\d+", " ".join(cells[1:])):
            if figure.replace(",", "") not in results:
                missing.append(f"{cells[0]!r}: {figure} is not in {source}")
    assert not missing, "\n".join(missing)


def test_every_table_of_figures_on_the_benchmarks_page_names_its_source_and_holds_to_it():
    """#49: a figure names where it comes from. A table of measurements on docs/benchmarks.md is introduced by a
    paragraph that names a results file (then every figure of the table is in that file, as committed) or, naming
    none, dates the run it records (YYYY-MM-DD: a record of that day, which a later rerun does not change)."""
    blocks = (ROOT / "docs" / "benchmarks.md").read_text().split("\n\n")
    unsourced, missing, checked = [], [], 0
    for before, table in zip(blocks, blocks[1:]):
        figures = re.findall(r"\d[\d,]*\.\d+(?![\dMk])", table)  # not a size such as 2.1M parameters
        if not table.lstrip().startswith("|") or not figures:
            continue
        sources = set(re.findall(r"bench/results[\w.-]*\.(?:md|json)", before))
        dated = re.search(r"20\d\d-\d\d-\d\d", before)
        head = table.splitlines()[0][:60]
        if not sources and not dated:
            unsourced.append(head)
        elif sources:
            checked += 1
            results = "".join((ROOT / f).read_text() for f in sorted(sources)).replace(",", "")
            missing += [f"{head}: {f} is not in {sorted(sources)}" for f in figures if f.replace(",", "") not in results]
    assert not unsourced, f"tables of figures naming neither a results file nor a run's date: {unsourced}"
    assert not missing, "\n".join(missing)
    assert checked >= 3  # the current results' tables (start-up and steps, the driver at scale, elastic)


_SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z(*`-])")
_FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*\.\d+(?![\dMk])")  # 0.57, 1,024.5; not 2.1M parameters, not a version


def figures_not_in_their_source(text: str) -> list[str]:
    """#49: in prose (tables have their own check), a sentence that names a results file quotes only figures that
    file holds; a record of an older run says its date instead of naming the file."""
    wrong = []
    for block in text.split("\n\n"):
        if block.lstrip().startswith("|"):
            continue
        for sentence in _SENTENCE_END.split(" ".join(block.split())):
            sources = sorted(set(re.findall(r"bench/results[\w.-]*\.(?:md|json|txt)", sentence)))
            if not sources:
                continue
            held = "".join((ROOT / f).read_text() for f in sources if (ROOT / f).exists()).replace(",", "")
            wrong += [f"{f} (in {', '.join(sources)}?): {sentence[:160]}..." for f in _FIGURE.findall(sentence)
                      if f.replace(",", "") not in held]
    return wrong


def test_every_figure_of_a_sentence_that_names_its_results_file_is_in_that_file():
    wrong = [f"{page.relative_to(ROOT)}: {w}" for page in PAGES for w in figures_not_in_their_source(page.read_text())]
    assert not wrong, "\n".join(wrong)


def test_the_sentence_check_finds_a_figure_its_file_does_not_hold():
    held = re.search(r"\| (\d+\.\d+) \|", (ROOT / "bench" / "results-scale.md").read_text()).group(1)
    assert figures_not_in_their_source(f"The driver took {held} cores (bench/results-scale.md).") == []
    assert figures_not_in_their_source("It took 9876.54 cores (bench/results-scale.md). Then 1.5 s.") == [
        "9876.54 (in bench/results-scale.md?): It took 9876.54 cores (bench/results-scale.md)...."]
    assert figures_not_in_their_source("A record: 9876.54 cores (2026-12-01).") == []  # names no file: a record
