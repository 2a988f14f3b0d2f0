"""The guides keep their shape: each ends by mapping what the reader did to build and CI work,
docs/README.md's reading path lists every guide with a reading time computed from its words,
every glossary term is explained or linked to the glossary where the path first uses it, and
every link between documents leads to a file and a section that exist: links within docs/, and
links to any Markdown file (each is a data dependency in docs/BUILD.bazel). Links to source files elsewhere in the repository are not
checked here: that would need the whole tree in this test's inputs."""

import math
import os
import re
from pathlib import Path

import pytest

# Not resolved: under Bazel the runfiles tree (with the files this test declares) is the world.
DOCS = Path(__file__).parent
MAPPING = "## What this maps to in build and CI work"
NOT_GUIDES = {"README.md", "glossary.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Technical prose with commands and output, read at a steady pace. Every word counts: prose,
# commands, output and tables (a reader reads the output the guide explains).
WORDS_PER_MINUTE = 200
CORE_PATH_MINUTES = 90
PATH_ROW = re.compile(r"^\| (\d+) \| \[([\w.]+)\]\([\w.]+\) \|[^|]*\| (\d+) min \|", re.M)
CORE_LINE = re.compile(r"Guides 1-(\d+) are the core path: (\d+) min of reading")


def guides() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_GUIDES)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def headings(path: Path, level: str = "## ") -> list[str]:
    in_code, out = False, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith(level):
            out.append(line.strip())
    return out


@pytest.mark.parametrize("guide", guides(), ids=lambda p: p.name)
def test_guide_ends_with_the_build_and_ci_mapping(guide):
    sections = headings(guide)
    assert sections, f"docs/{guide.name} has no sections"
    assert sections[-1] == MAPPING, (
        f"docs/{guide.name}: its last section is {sections[-1]!r}; every guide ends with "
        f"{MAPPING!r}"
    )


def test_reading_path_lists_every_guide():
    readme = (DOCS / "README.md").read_text()
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(readme)}
    missing = [g.name for g in guides() if g.name not in linked]
    assert not missing, f"docs/README.md does not list {missing}"
    assert "glossary.md" in linked


def links(path: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


@pytest.mark.parametrize("doc", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_links_lead_to_files_and_sections_that_exist(doc):
    broken = []
    for number, target in links(doc):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: (none are followed offline)
            continue
        file, _, anchor = target.partition("#")
        path = Path(os.path.normpath(doc.parent / file)) if file else doc
        if file.startswith("../") and not file.endswith(".md"):
            continue  # a source file elsewhere in the repository (see the docstring)
        if not path.exists():
            broken.append(f"docs/{doc.name}:{number}: {target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"docs/{doc.name}:{number}: {target}: no section #{anchor}")
    assert not broken, "\n".join(broken)


def test_every_glossary_term_links_to_a_section():
    rows = [
        line for line in (DOCS / "glossary.md").read_text().splitlines() if line.startswith("| ")
    ]
    terms = rows[2:]  # after the header and its rule
    assert len(terms) >= 40
    for row in terms:
        assert re.search(r"\]\([a-z_]+\.md#[\w-]+\)", row), (
            f"glossary: {row[:60]}... links no section"
        )


def test_slug_matches_github():
    assert slug(" 5. The full-size job: configs/tiny.yaml") == "5-the-full-size-job-configstinyyaml"
    assert slug('Surprise: on a CPU, MFU is "measured"') == "surprise-on-a-cpu-mfu-is-measured"


def words(path: Path) -> int:
    return len(path.read_text().split())


def minutes(word_count: int) -> int:
    return math.ceil(word_count / WORDS_PER_MINUTE)


def reading_path() -> list[tuple[int, str, int]]:
    """(number, guide, stated minutes) for each row of docs/README.md's path, in order."""
    rows = [(int(n), g, int(m)) for n, g, m in PATH_ROW.findall((DOCS / "README.md").read_text())]
    assert [n for n, _, _ in rows] == list(range(1, len(rows) + 1)), "path rows not numbered 1.."
    return rows


def test_reading_times_are_computed_from_words():
    wrong = [
        f"docs/README.md: guide {n} ({guide}) says {stated} min; its {words(DOCS / guide):,} "
        f"words at {WORDS_PER_MINUTE} wpm read in {minutes(words(DOCS / guide))} min"
        for n, guide, stated in reading_path()
        if stated != minutes(words(DOCS / guide))
    ]
    assert not wrong, "\n".join(wrong)


def test_core_path_reads_in_ninety_minutes():
    found = CORE_LINE.search((DOCS / "README.md").read_text())
    assert found, "docs/README.md does not say 'Guides 1-N are the core path: M min of reading'"
    last, stated = int(found.group(1)), int(found.group(2))
    core = ["README.md", *(g for n, g, _ in reading_path() if n <= last)]
    total = sum(words(DOCS / g) for g in core)
    assert stated == minutes(total), (
        f"docs/README.md: the core path ({', '.join(core)}) is {total:,} words: "
        f"{minutes(total)} min at {WORDS_PER_MINUTE} wpm, not {stated}"
    )
    assert minutes(total) <= CORE_PATH_MINUTES, (
        f"the core path reads in {minutes(total)} min, over {CORE_PATH_MINUTES}: move deep "
        "material to a later guide or a package README"
    )


def test_rest_of_path_time_is_computed():
    readme = (DOCS / "README.md").read_text()
    found = re.search(r"They add (\d+) min of reading", readme)
    assert found, "docs/README.md does not say 'They add N min of reading'"
    last = int(CORE_LINE.search(readme).group(1))
    total = sum(words(DOCS / g) for n, g, _ in reading_path() if n > last)
    assert int(found.group(1)) == minutes(total), (
        f"docs/README.md: guides after {last} are {total:,} words: {minutes(total)} min at "
        f"{WORDS_PER_MINUTE} wpm, not {found.group(1)}"
    )
