"""The house's import graph, walked from the source (every import, those inside functions included): no module
of `dlrm_lab` reaches itself again through the modules it imports."""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dlrm_lab"


def _imports() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dlrm_lab"):
                for alias in node.names:  # `from pkg import module` names the module; else the package module
                    edges[name].add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                                    else node.module)  # fmt: skip
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules)
    return {m: {t for t in edges[m] if t in modules and t != m} for m in modules}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    edges = _imports()
    assert len(edges) > 150  # the walk found the package
    assert _circles(edges) == []


def test_the_walk_finds_a_circle_where_there_is_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _rooms(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between rooms: a room is a top-level module or subpackage of `dlrm_lab` (its package root, which
    imports the families' implementations to register them, stands above every room and is left out)."""

    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None

    rooms: dict[str, set[str]] = collections.defaultdict(set)
    for source, targets in edges.items():
        if (a := room(source)) is None:
            continue
        rooms[a]  # a room that imports no other room still stands on a floor
        rooms[a].update(b for t in targets if (b := room(t)) is not None and b != a)
    return dict(rooms)


def test_every_import_between_rooms_runs_downhill():
    """No room reaches itself through others: the rooms stack into floors (docs/architecture.md), a concept that many
    rooms need (the model family's protocol and registry: `config.family`) stands low and its implementations
    register from above."""
    rooms = _rooms(_imports())
    assert {"config", "infer", "families", "metrics", "cli"} <= set(rooms)
    assert _circles(rooms) == []
    assert "families" not in set().union(*(t for r, t in rooms.items() if r != "families"))  # asked of by no room
    # the command line is the top floor: only the entry point imports it (a TorchX component parses train's words
    # with the library's parser, `commands.train_words`)
    assert {r for r, t in rooms.items() if "cli" in t} == {"__main__"}


def test_the_room_walk_finds_an_uphill_import():
    edges = {"dlrm_lab.config.a": {"dlrm_lab.metrics.b"}, "dlrm_lab.metrics.b": {"dlrm_lab.config.c"},
             "dlrm_lab.config.c": set(), "dlrm_lab": {"dlrm_lab.config.a"}}  # fmt: skip
    assert _circles(_rooms(edges)) == [["config", "metrics"]]


def test_no_module_is_over_500_lines():
    """A file holds one concept: past 500 lines it holds several (split it along them, not at a line count).
    gRPC's generated code aside."""
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500 and "_pb2" not in p.name}  # fmt: skip
    assert long == {}


def test_the_architecture_page_draws_the_floors_the_code_has():
    """docs/architecture.md's table of floors is the one the imports give (a room's floor: one above the highest
    room it imports), so the page a newcomer reads cannot drift from the code."""
    import functools
    import re

    rooms = _rooms(_imports())

    @functools.cache
    def floor(room: str) -> int:
        return 1 + max(map(floor, rooms[room])) if rooms[room] else 0

    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    drawn = {room: int(n) for n, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", page, re.M)
             for room in re.findall(r"`([a-z_]+)`", cell)}  # fmt: skip
    assert drawn == {room: floor(room) for room in rooms}


def test_no_private_name_is_imported_across_modules():
    """A leading underscore means "this module's own": a name another module needs is public (issue 58)."""
    crossing = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dlrm_lab"):
                crossing += [f"{path.relative_to(ROOT.parent)}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert crossing == []


def test_the_family_protocol_and_its_roles_name_no_any():
    """Every role a family plays is typed (issue 58): the protocol on the ground floor names no `Any`, and no role
    protocol a room defines takes or gives one (its signatures: a role's vocabulary may still hold loose data)."""
    assert "Any" not in {n.id for n in ast.walk(ast.parse((ROOT / "config" / "family.py").read_text()))
                         if isinstance(n, ast.Name)}  # fmt: skip
    tree = ast.parse((ROOT / "infer" / "serving_parts.py").read_text())
    (role,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServingParts"]
    methods = [f for f in role.body if isinstance(f, ast.FunctionDef)]
    annotated = [(*[x.annotation for x in f.args.args + f.args.kwonlyargs], f.returns) for f in methods]
    signatures = [a for each in annotated for a in each if a is not None]
    assert signatures and not [ast.unparse(a) for a in signatures if "Any" in ast.unparse(a)]


def _base_name(base: ast.expr) -> str:
    base = base.value if isinstance(base, ast.Subscript) else base  # Role[SpecT]: Role
    return base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""


def _mixed_classes(sources: dict[str, str]) -> list[str]:
    """Classes (module.Class) that inherit two or more classes defined in `sources` (module -> its code). A protocol
    composed of role protocols (`config.family.ModelFamily`) is an interface, not a mixin: it holds no state."""
    trees = {name: ast.parse(code) for name, code in sources.items()}
    ours = {n.name for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    mixed = []
    for name, tree in trees.items():
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = [_base_name(b) for b in node.bases]
            if "Protocol" not in bases and sum(b in ours for b in bases) >= 2:
                mixed.append(f"{name}.{node.name}")
    return mixed


def test_no_class_inherits_two_of_the_labs_own():
    """Parts are held as objects with their own state (docs/architecture.md, "Objects are composed"), not mixed into
    one class whose `__init__` sets the state of halves defined elsewhere (the server was, issue 58)."""
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in ROOT.rglob("*.py")}
    assert _mixed_classes(sources) == []
    assert _mixed_classes({"a": "class P: ...\nclass Q: ...\nclass S(P, Q): ...\nclass T(P, dict): ..."}) == ["a.S"]
    assert _mixed_classes(
        {"a": "class P: ...\nclass Q: ...\nclass S(P[T], Q): ...\nclass R(P, Q[T], Protocol[T]): ..."}
    ) == ["a.S"]


def test_no_room_reaches_the_package_root_or_names_a_module_by_string():
    """The package root stands above every room (it imports the registrations): a room importing a name from it, or
    naming another module as "module:function" for importlib, is a dependency the graph above cannot see (issue 58)."""
    found = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dlrm_lab":
                found += [f"{path.name}: from dlrm_lab import {a.name}" for a in node.names
                          if not (ROOT / a.name).exists() and not (ROOT / f"{a.name}.py").exists()]  # fmt: skip
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"dlrm_lab(\.\w+)+:\w+", node.value):
                    found.append(f"{path.name}: {node.value!r}")
    assert found == []


def test_only_the_targets_module_asks_whether_a_target_is_remote():
    """The runner speaks to the system under test through its protocol (issue 58): where a target is, and what that
    changes, is decided where targets are opened (`infer/targets.py`), and no code asks whether it holds the lab's
    own server (`isinstance(..., InferenceServer)`) or what it happens to have (`hasattr(server, ...)`: stalls, canary
    readings and tracing are the protocol's, `infer.sut.NoInstancesHere` for a system whose instances are elsewhere)."""
    found = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "infer" / "targets.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.ctx, ast.Load):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: .remote")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2
                    and "InferenceServer" in ast.unparse(node.args[1])):  # fmt: skip
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: isinstance InferenceServer")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr" and len(node.args) == 2
                    and ast.unparse(node.args[0]) in ("server", "sut", "self.server", "self.inference")):  # fmt: skip
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: hasattr on the system under test")
    assert found == []


def test_the_formatter_writes_the_package():
    """`ruff format` is the style (issue 58): the package is as it writes it, `# fmt: skip` kept under 50 lines."""
    import subprocess
    import sys

    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        import pytest

        pytest.skip("ruff is not installed beside this interpreter")
    done = subprocess.run([str(ruff), "format", "--check", str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    skips = sum(p.read_text().count("# fmt: skip") for p in ROOT.rglob("*.py"))
    assert skips < 50, skips


def test_the_package_type_checks():
    """`mypy` (`[tool.mypy]` in pyproject.toml: the whole package, the ground floors strictly) finds no error
    (issue 58): a new one fails here as in `make lint`."""
    import subprocess

    import pytest

    mypy = Path(sys.executable).parent / "mypy"
    if not mypy.exists():
        pytest.skip("mypy is not installed beside this interpreter")
    done = subprocess.run([str(mypy)], capture_output=True, text=True, cwd=ROOT.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_every_name_a_benchmark_or_a_test_imports_from_the_package_exists():
    """A name moved between modules broke `benchmarks/one_call.py` and `fixed_width_ab.py` for a session (they
    imported `make_runner` from where it no longer was): no test imports a benchmark, so check every
    `from dlrm_lab... import name` of the scripts and the tests against the package as it is, inside functions too."""
    import importlib
    import importlib.util

    missing = []
    for path in [*(ROOT.parent / "benchmarks").glob("*.py"), *(ROOT.parent / "tests").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dlrm_lab":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    submodule = hasattr(module, "__path__") and importlib.util.find_spec(name) is not None
                    if not hasattr(module, alias.name) and not submodule:
                        missing.append(f"{path.name}:{node.lineno}: {name}")
    assert not missing, missing


def test_every_gpu_test_lives_in_test_gpu():
    """`-m gpu` collects tests/test_gpu.py alone (conftest): a GPU test elsewhere would never run on a GPU host."""
    tests = Path(__file__).parent
    marked = re.compile(r"^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*\bgpu\b)", re.M)
    stray = [p.name for p in tests.glob("test_*.py") if p.name != "test_gpu.py" and marked.search(p.read_text())]
    assert stray == [] and marked.search((tests / "test_gpu.py").read_text())
