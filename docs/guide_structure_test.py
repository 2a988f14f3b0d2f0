"""The guides keep their shape: each ends by mapping what the reader did to build and CI work,
docs/README.md's reading path lists every guide with a reading time computed from its words,
every glossary term is explained or linked to the glossary where the path first uses it, and
every link between documents leads to a file and a section that exist: links within docs/, and
links to any Markdown file (each is a data dependency in docs/BUILD.bazel). Links to source
files elsewhere in the repository are not checked here: that would need the whole tree in this
test's inputs."""

import dataclasses
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
ANCHOR_TAG = re.compile(r'<a id="([\w-]+)"></a>')
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
    """Its headings' anchors, and the ids of `<a id="...">` tags (the glossary's terms)."""
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
        elif not in_code:
            out.update(ANCHOR_TAG.findall(line))
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
    core = CORE_LINE.search(readme)
    assert core, "docs/README.md does not say 'Guides 1-N are the core path: M min of reading'"
    last = int(core.group(1))
    total = sum(words(DOCS / g) for n, g, _ in reading_path() if n > last)
    assert int(found.group(1)) == minutes(total), (
        f"docs/README.md: guides after {last} are {total:,} words: {minutes(total)} min at "
        f"{WORDS_PER_MINUTE} wpm, not {found.group(1)}"
    )


# Words a guide uses in another sense than the glossary's term, which do not count as its
# first use: (word, guide) -> the sense meant there.
OTHER_SENSES = {
    ("step", "precook.md"): "a step of a build or of precook, not of training",
    ("policy", "launcher.md"): "the launcher's security policy",
    ("layout", "launcher.md"): "an OCI image's layout directory",
    ("shard", "launcher.md"): "a CI test shard",
    ("shard", "serve.md"): "a CI test shard",
    ("layout", "images.md"): "an OCI image's layout directory",
    ("policy", "precook_scale.md"): "a job's retry policy",
    ("shard", "precook_scale.md"): "a CI test shard",
    ("shard", "parallelism.md"): "to split a tensor across ranks",
    ("epoch", "launcher.md"): "a leader lease's epoch (its fencing token), not a pass over data",
}


@dataclasses.dataclass
class Term:
    name: str
    anchor: str
    defined_in: str  # the guide the glossary's "seen in" names
    phrases: list[str]


def glossary_terms() -> list[Term]:
    """Each row's term; its phrases are its ` / ` alternatives without a parenthesis, and a
    parenthesis that abbreviates them (`mixture of experts (MoE)`). A parenthesis that tells a
    sense apart (`layer (image)` from `layer`) leaves no phrase of its own: the plain word
    belongs to the plain term."""
    lines = (DOCS / "glossary.md").read_text().splitlines()
    out = []
    for number, row in enumerate(lines, 1):
        if not row.startswith("| ") or row.startswith(("| term |", "| ---")):
            continue
        cell, _, rest = row[2:].partition(" | ")
        anchor, seen_in = ANCHOR_TAG.search(cell), re.search(r"\]\(([\w.]+\.md)#", rest)
        assert anchor, f'docs/glossary.md:{number}: the term has no <a id="..."></a> anchor'
        assert seen_in, f"docs/glossary.md:{number}: no 'seen in' link to a guide's section"
        name = ANCHOR_TAG.sub("", cell)
        phrases = [re.sub(r"\s*\([^)]*\)", "", alt).strip() for alt in name.split(" / ")]
        phrases += [a for a in re.findall(r"\(([^)]+)\)", name) if is_abbreviation(a, phrases[0])]
        out.append(Term(name, anchor.group(1), seen_in.group(1), phrases))
    plain = {t.name for t in out}
    for term in out:
        if "(" in term.name and term.phrases[0] in plain:
            term.phrases = term.phrases[1:]
    return out


def is_abbreviation(short: str, words: str) -> bool:
    """`MoE` of `mixture of experts`, `TTFT` of `time to first token`."""
    initials = "".join(w[0] for w in re.split(r"[\s-]+", words) if w).lower()
    return " " not in short and len(short) > 1 and short.lower() in (initials, initials[:-1] + "e")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """Lines a reader reads as prose: not code blocks, not headings, without inline code."""
    out, in_code = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("#"):
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


LINKED = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def first_use(term: Term, guides: list[str]) -> tuple[str, int, str] | None:
    """(guide, line, link target or "") of the term's first use in reading order."""
    patterns = [
        re.compile(r"(?<![\w-])" + re.escape(p) + r"(?![\w-])", 0 if p != p.lower() else re.I)
        for p in term.phrases
    ]
    for guide in guides:
        for number, line in prose_lines(DOCS / guide):
            # Link targets are not read; a link's text is, and remembers where it leads.
            spans = [(m.start(1), m.end(1), m.group(2)) for m in LINKED.finditer(line)]
            text = LINKED.sub(lambda m: "[" + m.group(1) + "]" + " " * (len(m.group(2)) + 2), line)
            hits = [m.start() for p in patterns for m in p.finditer(text)]
            hits = [h for h in hits if (word_at(text, h), guide) not in OTHER_SENSES]
            if hits:
                at = min(hits)
                target = next((tgt for a, b, tgt in spans if a <= at < b), "")
                return guide, number, target
    return None


def word_at(text: str, at: int) -> str:
    """The word starting at `at` (where a phrase matched, so there is one)."""
    return re.split(r"[^\w-]", text[at:], maxsplit=1)[0].lower()


def test_every_glossary_term_is_explained_or_linked_at_first_use():
    # The guides in reading order; docs/README.md is their index, whose table previews each
    # guide's words and sends the reader to the glossary before any of them.
    guides = [g for _, g, _ in reading_path()]
    wrong = []
    for term in glossary_terms():
        use = first_use(term, guides)
        if use is None:
            continue
        guide, number, target = use
        # Linked to the glossary's entry, or to the guide that explains it.
        linked = target == f"glossary.md#{term.anchor}" or target.split("#")[0] == term.defined_in
        if guide == term.defined_in or linked:
            continue
        wrong.append(
            f"docs/{guide}:{number}: first use of {term.name!r} in reading order: link it, "
            f"[{term.phrases[0]}](glossary.md#{term.anchor}), or explain it in "
            f"docs/{term.defined_in} (the glossary's 'seen in') before"
        )
    assert not wrong, "\n".join(wrong)


def test_term_phrases():
    terms = {t.name: t.phrases for t in glossary_terms()}
    assert terms["mixture of experts (MoE)"] == ["mixture of experts", "MoE"]
    assert terms["decode / prefill"] == ["decode", "prefill"]
    assert terms["layer (image)"] == []  # `layer` is the plain term's
    assert terms["vocabulary (V)"] == ["vocabulary"]


# Where the series Kitchen exports are declared: the catalog of what trainers report, the
# launcher's own, and a serve job's /metrics. Read as text: a series is a "kitchen_..." literal.
SERIES_SOURCES = ("protos/metric_catalog.py", "launcher/metrics.py", "trainer/serve/metrics.py")


def test_every_exported_series_is_in_the_observability_guide():
    doc = (DOCS / "observability.md").read_text()
    missing = []
    for source in SERIES_SOURCES:
        text = (DOCS.parent / source).read_text()
        for name in sorted(set(re.findall(r'"(kitchen_[a-z0-9_]+)"', text))):
            if name not in doc:
                missing.append(f"{name} ({source})")
    assert not missing, "docs/observability.md does not name: " + ", ".join(missing)
