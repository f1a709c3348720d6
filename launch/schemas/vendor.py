"""Rebuild the vendored schemas of this folder from their published sources (README.md names them).

    python launch/schemas/vendor.py KUBERNETES_SWAGGER_JSON TRAINJOBS_CRD_YAML

KUBERNETES_SWAGGER_JSON: Kubernetes' OpenAPI v2 document (api/openapi-spec/swagger.json of a release branch);
TRAINJOBS_CRD_YAML: Kubeflow Trainer's manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml of a release.

What is kept: only the definitions the emitted kinds reach (batch/v1 Job, v1 Service; TrainJob v1alpha1),
without their descriptions (prose, most of the bytes). What is added, as yannh/kubernetes-json-schema's
"standalone-strict" schemas add it (openapi2jsonschema --strict): `additionalProperties: false` on every object
that lists its properties and says nothing of others (the API server's strict field validation, kubectl's
default, refuses unknown fields; a CRD field marked x-kubernetes-preserve-unknown-fields keeps them), apiVersion
and kind fixed for each top-level kind, and Kubernetes' two string-or-number formats (IntOrString, Quantity)
written as JSON Schema `oneOf`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
KINDS = {"batch/v1/Job": "io.k8s.api.batch.v1.Job", "v1/Service": "io.k8s.api.core.v1.Service"}
SPECIAL = {
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"oneOf": [{"type": "string"}, {"type": "number"}]},
}
DROP = {"description", "x-kubernetes-group-version-kind"}


def strict(node):
    """Descriptions dropped, unknown fields refused wherever an object lists its own."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key not in DROP}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def _refs(node, found):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for item in node:
            _refs(item, found)


def kubernetes(swagger: dict) -> dict:
    definitions = swagger["definitions"]
    keep, todo = set(), list(KINDS.values())
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        _refs(definitions[name], found)
        todo.extend(found - keep)
    out = {name: SPECIAL.get(name) or strict(definitions[name]) for name in sorted(keep)}
    for kind, name in KINDS.items():
        api_version, kind_name = kind.rsplit("/", 1)
        schema = out[name]
        schema["properties"]["apiVersion"] = {"type": "string", "enum": [api_version]}
        schema["properties"]["kind"] = {"type": "string", "enum": [kind_name]}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
    return {"kinds": {kind: {"$ref": f"#/definitions/{name}"} for kind, name in KINDS.items()}, "definitions": out}


def trainjob(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"{group}/v1alpha1"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "spec"})
    kinds = {f"{group}/v1alpha1/{kind}": {"$ref": "#/definitions/TrainJob"}}
    return {"kinds": kinds, "definitions": {"TrainJob": schema}}


def main(swagger_path: str, crd_path: str) -> None:
    swagger = json.loads(Path(swagger_path).read_text())
    (crd,) = [doc for doc in yaml.safe_load_all(Path(crd_path).read_text()) if doc]
    for name, doc in (("kubernetes-1.33.json", kubernetes(swagger)), ("kubeflow-trainer-v2.3.0.json", trainjob(crd))):
        (HERE / name).write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
        print(name, (HERE / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main(*sys.argv[1:])
