"""The docs' promises that name tests: every row of the fault catalogue (docs/faults.md)
names tests that exist, so a case cannot be documented without being held."""

import ast
import re

from conftest import ROOT


def _test_functions(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_fault_catalogue_row_names_tests_that_exist():
    text = (ROOT / "docs" / "faults.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) >= 25
    cases = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        case, _command, _sees, code, _kept, tests = cells
        assert code in {"0", "1", "2", "130", "137", "139", "-", "1 (serve 0)"}, row
        named = re.findall(r"(tests/\w+\.py)::(\w+)", tests)
        assert named, f"{case}: names no test"
        for path, name in named:
            assert name in _test_functions(ROOT / path), f"{case}: {path}::{name} does not exist"
        cases.add(case)
    assert len(cases) == len(rows)  # one row per case
    assert "docs/faults.md" in (ROOT / "README.md").read_text()  # the catalogue is findable


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_markdown_link_to_a_heading_finds_it():
    pages = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    checked = 0
    for page in pages:
        for target, fragment in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            assert linked.exists(), f"{page.name}: link to {target}, which does not exist"
            anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
            assert fragment in anchors, f"{page.name}: #{fragment} is no heading of {linked.name}"
            checked += 1
    assert checked > 50  # BENCHMARKS.md's dashboard alone links its sections
