"""Offline validation of custom resources against the CRDs shipped in deploy/crds.

Why: kubernetes-validate bundles the schemas of built-in kinds only; ScaledObject (KEDA) and
RayJob/RayCluster (KubeRay) would otherwise go unchecked. A CRD's openAPIV3Schema is turned into a
JSON Schema with the API server's strict semantics (an object that lists its properties accepts
no others unless it sets x-kubernetes-preserve-unknown-fields; int-or-string is either), then
checked with jsonschema. Pod templates inside custom resources are left open by the CRDs and are
returned by `pod_templates` so callers validate them as real core/v1 PodTemplateSpecs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

Obj = dict[str, Any]

# Keywords of OpenAPI v3 that JSON Schema (draft 7) reads the same way.
_KEEP = frozenset(
    {
        "type",
        "format",
        "enum",
        "required",
        "minimum",
        "maximum",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "description",
    }
)


class CustomResourceError(ValueError):
    """A custom resource that its CRD rejects, or one no shipped CRD covers."""


def to_json_schema(node: Obj) -> Obj:
    """OpenAPI v3 (structural CRD schema) -> JSON Schema with strict unknown-field handling."""
    out: Obj = {k: v for k, v in node.items() if k in _KEEP}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    elif "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        # What the API server's strict field validation does for fields the schema does not list.
        # (A bare `type: object`, like `metadata`, is left to the API server's own rules.)
        out["additionalProperties"] = False
    if "anyOf" in node and "anyOf" not in out:
        out["anyOf"] = [to_json_schema(s) for s in node["anyOf"]]
    return out


class CrdRegistry:
    """The CRDs of a directory, indexed by (apiVersion, kind)."""

    def __init__(self, crd_dir: str | Path) -> None:
        self.schemas: dict[tuple[str, str], Obj] = {}
        self.crds: list[Obj] = []
        for path in sorted(Path(crd_dir).glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                self.crds.append(doc)
                spec = doc["spec"]
                for version in spec["versions"]:
                    api_version = f"{spec['group']}/{version['name']}"
                    schema = to_json_schema(version["schema"]["openAPIV3Schema"])
                    jsonschema.Draft7Validator.check_schema(schema)
                    self.schemas[(api_version, spec["names"]["kind"])] = schema

    def covers(self, obj: Obj) -> bool:
        return (obj.get("apiVersion", ""), obj.get("kind", "")) in self.schemas

    def validate(self, obj: Obj) -> None:
        """Raise CustomResourceError naming the object and the offending path."""
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        name = obj.get("metadata", {}).get("name", "?")
        if key not in self.schemas:
            raise CustomResourceError(f"{key[1]} {name}: no CRD for {key[0]}/{key[1]} in deploy/crds")
        errors = sorted(jsonschema.Draft7Validator(self.schemas[key]).iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "<root>"
            raise CustomResourceError(f"{key[1]} {name}: at {where}: {errors[0].message}")


def pod_templates(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(path, PodTemplateSpec) for every pod template inside a custom resource's spec."""

    def walk(node: Any, path: str) -> Iterator[tuple[str, Obj]]:
        if isinstance(node, dict):
            for key, value in node.items():
                sub = f"{path}/{key}"
                if key in ("template", "submitterPodTemplate") and isinstance(value, dict) and "spec" in value:
                    yield sub, value
                else:
                    yield from walk(value, sub)
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{path}/{i}")

    yield from walk(obj.get("spec", {}), "spec")


def as_pod_template(template: Obj, name: str) -> Obj:
    """Wrap a PodTemplateSpec in a core/v1 PodTemplate object so kubernetes-validate checks it."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
