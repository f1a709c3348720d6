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
