"""The model-family seam: one file per family, found without a list, and nothing else branches on it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import dlrm_lab
from dlrm_lab.config import family as families
from dlrm_lab.config import load_any_preset
from dlrm_lab.config.family import ModelFamily, family_named, family_of, spec_from_dict
from dlrm_lab.errors import UserError

PACKAGE = Path(dlrm_lab.__file__).parent
SPEC_TYPES = {"ModelSpec", "HSTUSpec"}


def _protocol_members() -> set[str]:
    """The members of ModelFamily, of the role protocols it is composed of, and of the roles in the rooms whose
    types they speak in (every family has each; the ranker alone streams)."""
    from dlrm_lab.data import DataParts
    from dlrm_lab.infer.serving_parts import ServingParts
    from dlrm_lab.model.cost import SampleCostParts
    from dlrm_lab.train.preflight import TrainingChecks

    roles = [c for c in ModelFamily.__mro__ if c.__module__ == ModelFamily.__module__]
    roles += [DataParts, SampleCostParts, TrainingChecks, ServingParts]
    own = {name for c in roles for name in (*c.__dict__, *getattr(c, "__annotations__", {}))}
    return {name for name in own if not name.startswith("_")}


def test_every_family_provides_the_whole_protocol():
    members = _protocol_members()
    assert {"parse_preset", "build", "sample_cost", "gemm_shapes", "sharder", "open_sources", "sample_library",
            "make_runner", "memory", "describe"} <= members  # fmt: skip
    assert set(families.families()) == {"dlrm", "hstu"}
    for family in families.families().values():
        missing = sorted(m for m in members if not hasattr(family, m))
        assert not missing, f"family {family.name} lacks {missing}"
    # a role asked for where it is needed: the ranker streams its time windows, a DLRM has none (one line)
    from dlrm_lab.data.streaming import streaming_of

    assert streaming_of(families.families()["hstu"]) is families.families()["hstu"]
    with pytest.raises(UserError, match="tiny .*has no time windows"):
        streaming_of(families.families()["dlrm"], "tiny")


@pytest.mark.parametrize("preset", ["tiny", "dcnv2", "hstu-tiny"])
def test_a_preset_is_parsed_costed_and_read_back_by_its_own_family(preset):
    spec = load_any_preset(preset)
    family = family_of(spec)
    assert isinstance(spec, family.spec_type) and family is family_named(family.name)
    assert spec_from_dict(spec.to_dict()) == spec  # as a run's manifest holds it
    cost = family.sample_cost(spec, "fp32", "rowwise_adagrad", "train")
    assert cost.forward_flops > 0 and cost.backward_flops > cost.forward_flops
    shapes = family.gemm_shapes(spec, 64, 512)
    assert shapes and all(0 < rows <= 512 and k > 0 and n > 0 for rows, k, n in shapes)
    assert family.size_line(spec).startswith(spec.name)


def test_an_unknown_family_is_one_line_naming_the_known_ones(tmp_path):
    path = tmp_path / "odd.toml"
    path.write_text('name = "odd"\nfamily = "gnn"\n')
    with pytest.raises(UserError, match=r"family = 'gnn': allowed: dlrm, hstu"):
        load_any_preset(str(path))
    with pytest.raises(UserError, match="unknown model family 'gnn'; known: dlrm, hstu"):
        family_named("gnn")


@dataclasses.dataclass(frozen=True)
class _ToySpec:
    name: str
    width: int
    family: str = "toy"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _ToyFamily:
    """A third family as a newcomer would write it: its own spec and file, nothing edited elsewhere."""

    name, label, called, spec_type = "toy", "toy ranker", "a toy ranker", _ToySpec

    def parse_preset(self, raw, *, where, table_scale, max_rows):
        return _ToySpec(raw["name"], int(raw["width"]))

    def spec_from_dict(self, data):
        return _ToySpec(data["name"], data["width"])

    def sample_cost(self, spec, table_precision, optimizer, window):
        from dlrm_lab.model.cost import SampleCost

        f = 2 * spec.width * spec.width
        return SampleCost(0, f, 0, f, 2 * f, 0.0, 0.0, 0.0)

    def gemm_shapes(self, spec, rows, max_rows):
        return [(min(rows, max_rows), spec.width, spec.width)]


def test_a_third_family_plugs_in_without_an_edit_elsewhere(tmp_path, monkeypatch):
    """The registry, the preset loader, the cost model and the precision check's shapes reach a family that
    only registered itself (as a module in dlrm_lab/families/ does through `register_family`)."""
    from dlrm_lab.metrics.precision import MAX_ROWS, model_gemm_shapes
    from dlrm_lab.model.cost import sample_cost

    monkeypatch.setitem(families.families(), "toy", _ToyFamily())  # as `register_family` does, undone after
    path = tmp_path / "toy.toml"
    path.write_text('name = "toy-small"\nfamily = "toy"\nwidth = 8\n')
    spec = load_any_preset(str(path))
    assert spec == _ToySpec("toy-small", 8) and family_of(spec).name == "toy"
    assert sample_cost(spec).forward_flops == 128 and sample_cost(spec).training_flops == 384
    assert model_gemm_shapes(spec, 10_000) == [(MAX_ROWS, 8, 8)]
    assert spec_from_dict(spec.to_dict()) == spec


def _branches_on_a_spec_type(tree: ast.AST) -> list[int]:
    """Lines of `isinstance(x, <a family's spec type>)` and of comparisons with a family's name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(getattr(k, "id", None) in SPEC_TYPES for k in kinds):
                lines.append(node.lineno)
        if isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Constant) and c.value == "hstu" for c in [node.left, *node.comparators]
        ):
            lines.append(node.lineno)
    return lines


def test_nothing_outside_the_families_branches_on_a_family():
    """DESIGN.md: "Nothing else branches on the family." A family's own modules (its spec's parser, its model)
    may; everything else asks `family_of(spec)`."""
    own = {"families", "config/hstu.py", "config/presets.py", "model/hstu.py", "model/dlrm.py"}
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel == o or rel.startswith(o + "/") for o in own):
            continue
        if lines := _branches_on_a_spec_type(ast.parse(path.read_text(), rel)):
            offenders[rel] = lines
    assert not offenders, f"family branches outside dlrm_lab/families: {offenders}"


def test_every_writer_of_a_shared_table_has_every_familys_columns():
    """The tables a run writes have the same columns whichever family it served: the writers' own imports
    register every family's columns (a fresh process, as a run starts)."""
    import subprocess
    import sys

    code = ("import dlrm_lab.infer.lab, dlrm_lab.infer.search, dlrm_lab.serve.server\n"
            "from dlrm_lab.metrics.columns import names_of\n"
            "print(all(c in names_of(t) for t, c in [('queries', 'history_reused'), "
            "('infer summary', 'history_hit_rate'), ('frontier', 'best_history_hit_rate')]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
