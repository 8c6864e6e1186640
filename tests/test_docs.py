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
    "time added to a short step": "bench/results.md",
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
        for figure in _WHOLE_OR_DECIMAL.findall(" ".join(cells)):
            if not held_in(figure, results):
                missing.append(f"{cells[0]!r}: {figure} is not in {source}")
    assert not missing, "\n".join(missing)


# A figure, whole (161, 1,024) or not (0.43): not a part of a word, a version or a size such as 2.1M.
_WHOLE_OR_DECIMAL = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?!\.\d|[^\Wx]|x\w)")  # 0.50x is one


def held_in(figure: str, results: str) -> bool:
    """Whether ``results`` (commas taken out) holds ``figure`` as a number of its own: 161 is not in 1610 or 0.161.

    >>> held_in("1,024", "at 1024 ranks"), held_in("161", "1610 MB"), held_in("0.43", "p50 0.43 s")
    (True, False, True)
    """
    return re.search(r"(?<![\d.])" + re.escape(figure.replace(",", "")) + r"(?!\d|\.\d)", results) is not None


def test_the_table_check_reads_whole_numbers_too():
    """#57.4: only figures with a decimal point were checked (161 MB, 0 of 30, 1,024 never were)."""
    assert _WHOLE_OR_DECIMAL.findall("0.17 cores, 161 MB; 0 of 30; 1,024 ranks; a 2.1M-parameter MLP (0.50x)") == [
        "0.17", "161", "0", "30", "1,024", "0.50"]
    assert not held_in("162", "161 MB") and held_in("30", "0 of 30 runs")


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


# --- claims about the code: line numbers, flags, variables, the launchers -----------------------------------------

_CITED_LINE = re.compile(r"in ([\w.]+) \((\w+\.py):(\d+)(?: <- \w+ ([\w.]+))?\)")


def test_every_cited_line_of_a_file_of_the_project_is_where_the_page_says():
    """#57.5: docs/faults.md's stacks named fns.py lines that had moved. ``in FUNC (FILE.py:N)`` is a frame of
    FUNC at line N; ``(FILE.py:N <- library CALL)``: line N makes that call. Files not in the project (train.py of
    an example) are not checked."""
    files = {}
    for f in ROOT.rglob("*.py"):
        if ".venv" not in f.parts:
            files.setdefault(f.name, []).append(f)
    wrong, checked = [], 0
    for page in PAGES:
        for func, name, line, call in _CITED_LINE.findall(page.read_text()):
            if len(files.get(name, [])) != 1:
                continue
            lines = files[name][0].read_text().splitlines()
            n = int(line)
            text = lines[n - 1] if n <= len(lines) else ""
            checked += 1
            if call:
                ok = f"{call.rsplit('.', 1)[-1]}(" in text
            else:
                defs = [ln for ln in lines[:n] if re.match(r"\s*def \w+", ln)]
                ok = bool(defs) and re.match(rf"\s*def {func.rsplit('.', 1)[-1]}\b", defs[-1]) is not None
            if not ok:
                wrong.append(f"{page.relative_to(ROOT)}: in {func} ({name}:{line}): line {line} is {text.strip()!r}")
    assert checked >= 4
    assert not wrong, "\n".join(wrong)


def test_the_options_launch_md_gives_each_verb_are_that_verbs():
    """#57.4: docs/launch.md gave --fresh to every verb while submit refused it. Its paragraph on raylaunch's options:
    those before "and for `launch`" belong to launch, submit and validate; then launch's, then submit's."""
    from jobs.spec.launch import _parser_actions

    text = " ".join((ROOT / "docs" / "launch.md").read_text().split())
    para = text.split("raylaunch's options come before the script:", 1)[1].split(". Without", 1)[0]
    common, rest = para.split("and for `launch`", 1)
    own, submit = rest.split("for `submit`", 1)
    flags = lambda part: set(re.findall(r"`(--[a-z][a-z_-]*)", re.sub(r"\(default: [^)]*\)", "", part)))  # noqa: E731
    wrong = []
    for verbs, part in ((("launch", "submit", "validate"), common), (("launch",), own), (("submit",), submit)):
        assert flags(part), part
        for verb in verbs:
            has = {o for a in _parser_actions(verb) for o in a.option_strings}
            wrong += [f"`raylaunch {verb}` has no {f}" for f in sorted(flags(part) - has)]
    assert not wrong, wrong


def test_every_accelerate_launch_of_n_processes_starts_n():
    """#57.4: `accelerate launch --cpu --num_processes 2` starts ONE process (Accelerate's simple launcher), so it is
    not the peer of a 2-process run; ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu ...`` starts two."""
    import shlex

    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    wrong = []
    for where, line in _commands("accelerate launch") + _commands("ACCELERATE_USE_CPU=true"):
        argv = shlex.split(line.split("  ")[0])
        args = parser.parse_args(argv[argv.index("launch") + 1:])
        # accelerate's launch_command: with --cpu every launcher but the one-process one is skipped
        if (args.num_processes or 1) > 1 and args.cpu:
            wrong.append(f"{where}: {line}: --cpu starts one process, not {args.num_processes}")
    assert not wrong, "\n".join(wrong)


def test_the_variables_spec_md_says_raylaunch_sets_are_set_by_it():
    """#57.4: docs/spec.md listed ROLE_RANK and ROLE_WORLD_SIZE among the variables raylaunch sets (reserved only).
    Each variable the sentence names before "and two that" appears as a key raylaunch's cluster code writes."""
    text = " ".join((ROOT / "docs" / "spec.md").read_text().split())
    said = text.split("Variables raylaunch sets itself (", 1)[1].split(";", 1)[0]
    names = re.findall(r"`([A-Z_]+)`", said)
    assert len(names) >= 10, said
    code = "".join(f.read_text() for f in (ROOT / "cluster").rglob("*.py"))
    assert [n for n in names if f'"{n}"' not in code] == []


def test_the_ray_commands_of_the_docs_are_rays():
    """`ray up`, `ray get-auth-token --generate`, ... as the README walks them: each a command of Ray's own CLI,
    with options it has (read by its click parser, nothing run)."""
    import shlex

    from ray.scripts.scripts import cli

    commands = _commands("ray")
    assert {line.split()[1] for _, line in commands} >= {"get-auth-token", "up", "dashboard", "down"}
    wrong = []
    for where, line in commands:
        argv = shlex.split(re.sub(r"\s+&\s*$", "", line))[1:]  # `ray dashboard FILE &`: in the background
        command = cli.get_command(None, argv[0])
        try:
            assert command is not None, f"no command {argv[0]}"
            command.make_context(f"ray {argv[0]}", argv[1:])
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - click raises its usage errors
            wrong.append(f"{where}: {line}: {exc}")
    assert not wrong, "\n".join(wrong)


def test_every_submit_of_a_multi_node_spec_names_storage_every_node_sees():
    """#57.3: the README's `raylaunch submit jobs/examples/digits.yaml --address ... --follow` kept runs in the spec's
    ~/raylaunch-runs, each node's own disk, which a run on several nodes refuses. Each submit of a spec file in the
    docs is planned as `--dry-run` plans it (the spec, its function, the upload; nothing sent), and one of more than
    one node gives a storage that is not a home folder."""
    import shlex

    from jobs.submit import plan_submit

    wrong, planned = [], 0
    for where, line in _commands("raylaunch submit"):
        argv = shlex.split(line)[2:]
        spec = next((a for a in argv if a.endswith((".yaml", ".yml"))), None)
        if spec is None or not (ROOT / spec).exists():
            continue
        storage = argv[argv.index("--storage") + 1] if "--storage" in argv else None
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        request = plan_submit(spec, sets, "http://127.0.0.1:8265", cwd=ROOT,
                              literals={"storage": storage} if storage else {})
        planned += 1
        if request.spec.scaling.num_nodes > 1 and request.spec.storage.startswith(("~", "/home", "/root")):
            wrong.append(f"{where}: {line}: runs in {request.spec.storage}, each node's own disk: give --storage")
    assert planned >= 2
    assert not wrong, "\n".join(wrong)


def test_the_progress_line_of_cli_md_is_the_one_run_prints():
    """#57.5: docs/cli.md's example line had lost its ending (` world N`). A plain progress line printed by the
    view, every figure read as 9, is the page's example read the same way."""
    import io

    from jobs.progress import ProgressView
    from jobs.run.events import AttemptStarted, ProgressShown, Reserved

    out = io.StringIO()
    view = ProgressView.for_stream(out)
    for e in (AttemptStarted(time=0, attempt=1), Reserved(time=0, attempt=1, world_size=2),
              ProgressShown(time=0, step=436, values={"total_steps": "1800", "loss": "1.056", "samples_per_s": "719.6"})):
        view.event(e)
    view.close()
    # (a first line knows no rate yet: its remaining time is ?)
    shape = lambda line: re.sub(r"\d+(\.\d+)?", "9", line).replace("remaining ?", "remaining 9:9")  # noqa: E731
    printed = [shape(line) for line in out.getvalue().splitlines() if line.startswith("raylaunch: step ")]
    page = (ROOT / "docs" / "cli.md").read_text()
    shown = [shape(line) for line in page.splitlines() if line.startswith("raylaunch: step ")]
    assert printed and shown == printed[:1], (shown, printed)
