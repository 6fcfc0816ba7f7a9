"""A small, offline renderer for the subset of Kustomize that deploy/k8s uses.

Why: `kustomize build` is not installable on the project's CI and dev machines (nothing may be
downloaded at test time), yet every overlay must be rendered to validate what a cluster would
receive. This module renders a kustomization directory the way `kustomize build` does for the
fields below, and rejects any other field so the manifests cannot drift outside what is checked.

Supported kustomization fields: resources (files and directories), namespace, labels (pairs,
includeSelectors, includeTemplates), images (name, newName, newTag, digest), patches (strategic
merge or JSON 6902, from `path` or inline `patch`, with an optional `target`), configMapGenerator
and secretGenerator (files, literals, envs, behavior create|merge|replace, options), and
generatorOptions. Generated names get a content-hash suffix (not byte-identical to kustomize's)
and references to them in built-in workloads are rewritten, as kustomize does; references inside
custom resources are left alone, as kustomize does too.

Usage: python deploy/tools/kustomize_lite.py deploy/k8s/overlays/dev   (prints the YAML stream)
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
# libyaml when PyYAML was built with it: ten times faster on these files.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

SUPPORTED_FIELDS = frozenset(
    {
        "apiVersion",
        "kind",
        "resources",
        "namespace",
        "labels",
        "images",
        "patches",
        "configMapGenerator",
        "secretGenerator",
        "generatorOptions",
    }
)
CLUSTER_SCOPED = frozenset(
    {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
)
WORKLOAD_KINDS = frozenset({"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"})
# patchMergeKey of the list fields the patches here touch (from the Kubernetes API types);
# other lists are replaced whole, as for fields without a merge key.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render; the message names the file and the field."""


def _load_yaml_docs(path: Path) -> list[Obj]:
    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=LOADER) if d is not None]
    except yaml.YAMLError as exc:
        raise KustomizeError(f"{path}: not valid YAML: {exc}") from exc
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise KustomizeError(f"{path}: every document must be an object with apiVersion and kind")
    return docs


def _inside(root: Path, rel: str, what: str) -> Path:
    """Files a kustomization reads must sit in or below its directory (kustomize's load restrictor)."""
    p = (root / rel).resolve()
    if root.resolve() not in (p, *p.parents):
        raise KustomizeError(f"{root}/kustomization.yaml: {what} {rel!r} is outside the kustomization directory")
    if not p.exists():
        raise KustomizeError(f"{root}/kustomization.yaml: {what} {rel!r} does not exist")
    return p


def _ident(obj: Obj) -> tuple[str, str, str]:
    meta = obj.get("metadata", {})
    return obj["kind"], meta.get("namespace", ""), meta["name"]


# ---------------------------------------------------------------- generators


def _content_hash(obj: Obj) -> str:
    payload = json.dumps(
        {"kind": obj["kind"], "data": obj.get("data", {}), "type": obj.get("type", "")}, sort_keys=True
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()
    # kustomize-style suffix alphabet: no vowels, so a suffix never spells a word.
    return "".join("bcdfghkmt2456789"[int(c, 16)] for c in digest[:10])


def _kv_pairs(root: Path, spec: Obj, where: str) -> dict[str, str]:
    data: dict[str, str] = {}
    for item in spec.get("files", []):
        key, sep, rel = str(item).partition("=")
        if not sep:
            key, rel = Path(item).name, item
        data[key] = _inside(root, rel, "file").read_text()
    for item in spec.get("literals", []):
        key, sep, value = str(item).partition("=")
        if not sep:
            raise KustomizeError(f"{where}: literal {item!r} is not KEY=VALUE")
        data[key] = value
    for rel in spec.get("envs", []):
        for n, line in enumerate(_inside(root, rel, "env file").read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise KustomizeError(f"{where}: {rel}:{n}: {line!r} is not KEY=VALUE")
            data[key] = value
    unknown = set(spec) - {"name", "files", "literals", "envs", "behavior", "options", "type"}
    if unknown:
        raise KustomizeError(f"{where}: unsupported generator fields {sorted(unknown)}")
    return data


def _generate(root: Path, kust: Obj, acc: list[Obj]) -> None:
    default_opts = kust.get("generatorOptions", {}) or {}
    where = f"{root}/kustomization.yaml"
    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in kust.get(field, []) or []:
            name = spec.get("name")
            if not name:
                raise KustomizeError(f"{where}: {field} entry without a name")
            data = _kv_pairs(root, spec, f"{where}: {field} {name!r}")
            behavior = spec.get("behavior", "create")
            opts = {**default_opts, **(spec.get("options", {}) or {})}
            existing = [o for o in acc if o["kind"] == kind and o["metadata"]["name"] == name]
            if behavior == "create":
                if existing:
                    raise KustomizeError(f"{where}: {kind} {name!r} already exists; use behavior: merge or replace")
                obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}
                acc.append(obj)
            elif behavior in ("merge", "replace"):
                if len(existing) != 1:
                    raise KustomizeError(f"{where}: behavior {behavior} needs exactly one existing {kind} {name!r}")
                obj = existing[0]
                if behavior == "replace":
                    obj.pop("data", None)
            else:
                raise KustomizeError(f"{where}: unknown generator behavior {behavior!r}")
            if kind == "Secret":
                encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
                obj["data"] = {**obj.get("data", {}), **encoded}
                obj["type"] = spec.get("type", obj.get("type", "Opaque"))
            else:
                obj["data"] = {**obj.get("data", {}), **data}
            if opts.get("labels"):
                obj["metadata"].setdefault("labels", {}).update(opts["labels"])
            obj["metadata"]["_origName"] = name
            obj["metadata"]["_hash"] = not opts.get("disableNameSuffixHash", False)


def _finalize_names(acc: list[Obj]) -> dict[tuple[str, str], str]:
    """Give generated objects their final names (hash suffix unless disabled); drop the markers."""
    renames: dict[tuple[str, str], str] = {}
    for obj in acc:
        meta = obj["metadata"]
        orig = meta.pop("_origName", None)
        hashed = meta.pop("_hash", False)
        if orig is None:
            continue
        meta["name"] = f"{orig}-{_content_hash(obj)}" if hashed else orig
        renames[(obj["kind"], orig)] = meta["name"]
    return renames


def _rewrite_refs(node: Any, renames: dict[tuple[str, str], str]) -> None:
    """Point ConfigMap/Secret references of a workload at the generated (suffixed) names."""
    if isinstance(node, list):
        for item in node:
            _rewrite_refs(item, renames)
        return
    if not isinstance(node, dict):
        return
    refs = (
        ("configMap", "name", "ConfigMap"),
        ("configMapRef", "name", "ConfigMap"),
        ("configMapKeyRef", "name", "ConfigMap"),
        ("secret", "secretName", "Secret"),
        ("secretRef", "name", "Secret"),
        ("secretKeyRef", "name", "Secret"),
    )
    for field, key, kind in refs:
        ref = node.get(field)
        if isinstance(ref, dict) and (kind, ref.get(key)) in renames:
            ref[key] = renames[(kind, ref[key])]
    for value in node.values():
        _rewrite_refs(value, renames)


# ---------------------------------------------------------------- patches


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge patch for the fields used here: maps merge, keyed lists merge by key,
    other lists are replaced, `null` deletes a key."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    merge_key = MERGE_KEYS.get(field)
    if isinstance(target, list) and isinstance(patch, list) and merge_key:
        out_list = [copy.deepcopy(t) for t in target]
        for item in patch:
            if not isinstance(item, dict) or merge_key not in item:
                raise KustomizeError(f"patch list {field!r}: every item needs its merge key {merge_key!r}")
            match = [i for i, t in enumerate(out_list) if isinstance(t, dict) and t.get(merge_key) == item[merge_key]]
            if match:
                out_list[match[0]] = strategic_merge(out_list[match[0]], item, field)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON patch path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json6902(obj: Obj, ops: list[Obj]) -> Obj:
    """JSON patch (RFC 6902) operations add, replace and remove."""
    out = copy.deepcopy(obj)
    for op in ops:
        parts = _pointer(op.get("path", ""))
        parent: Any = out
        for part in parts[:-1]:
            try:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            except (KeyError, IndexError, ValueError):
                raise KustomizeError(f"JSON patch {op}: path does not exist in {_ident(obj)}") from None
        last = parts[-1]
        kind = op.get("op")
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(idx, copy.deepcopy(op["value"]))
            elif kind == "replace" and idx < len(parent):
                parent[idx] = copy.deepcopy(op["value"])
            elif kind == "remove" and idx < len(parent):
                del parent[idx]
            else:
                raise KustomizeError(f"JSON patch {op}: cannot apply to {_ident(obj)}")
        elif kind == "add":
            parent[last] = copy.deepcopy(op["value"])
        elif kind in ("replace", "remove"):
            if last not in parent:
                raise KustomizeError(f"JSON patch {op}: {op['path']} does not exist in {_ident(obj)}")
            if kind == "replace":
                parent[last] = copy.deepcopy(op["value"])
            else:
                del parent[last]
        else:
            raise KustomizeError(f"JSON patch op {kind!r} is not supported (add, replace, remove)")
    return out


def _matches(obj: Obj, target: Obj) -> bool:
    if target.get("kind") and obj["kind"] != target["kind"]:
        return False
    if target.get("name") and not re.fullmatch(target["name"], obj["metadata"]["name"]):
        return False
    if target.get("namespace") and obj["metadata"].get("namespace") != target["namespace"]:
        return False
    for sel in filter(None, str(target.get("labelSelector", "")).split(",")):
        key, _, value = sel.partition("=")
        if obj["metadata"].get("labels", {}).get(key.strip()) != value.strip():
            return False
    return True


def _apply_patches(root: Path, kust: Obj, acc: list[Obj]) -> list[Obj]:
    where = f"{root}/kustomization.yaml"
    for entry in kust.get("patches", []) or []:
        unknown = set(entry) - {"path", "patch", "target"}
        if unknown:
            raise KustomizeError(f"{where}: unsupported patch fields {sorted(unknown)}")
        text = _inside(root, entry["path"], "patch").read_text() if "path" in entry else entry.get("patch", "")
        body = yaml.load(text, Loader=LOADER)
        target = entry.get("target")
        if isinstance(body, list):
            if not target:
                raise KustomizeError(f"{where}: a JSON 6902 patch needs a target")
            hits = [i for i, o in enumerate(acc) if _matches(o, target)]
            for i in hits:
                acc[i] = json6902(acc[i], body)
        elif isinstance(body, dict):
            sel = target or {"kind": body.get("kind"), "name": re.escape(body.get("metadata", {}).get("name", ""))}
            hits = [i for i, o in enumerate(acc) if _matches(o, sel)]
            for i in hits:
                patch = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")}
                acc[i] = strategic_merge(acc[i], patch)
        else:
            raise KustomizeError(f"{where}: patch {entry} is neither a map nor a list of operations")
        if not hits:
            raise KustomizeError(f"{where}: patch {entry.get('path', '<inline>')} matches no resource")
    return acc


# ---------------------------------------------------------------- transformers


def _containers(node: Any) -> Iterator[Obj]:
    """Every container and init container at any depth (kustomize's image transformer does the same)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _split_image(image: str) -> tuple[str, str, str]:
    """`repo[:tag][@digest]` -> (repo, tag, digest); a ':' before the last '/' is a registry port."""
    ref, _, digest = image.partition("@")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :], digest
    return ref, "", digest


def _set_images(acc: list[Obj], images: list[Obj]) -> None:
    for obj in acc:
        for c in _containers(obj):
            repo, tag, digest = _split_image(str(c.get("image", "")))
            for rule in images:
                if rule["name"] != repo:
                    continue
                new = rule.get("newName", repo)
                digest = rule.get("digest", digest)
                tag = str(rule.get("newTag", tag))
                c["image"] = new + (f":{tag}" if tag and not digest else "") + (f"@{digest}" if digest else "")


def _set_labels(acc: list[Obj], rules: list[Obj]) -> None:
    for rule in rules:
        pairs = {str(k): str(v) for k, v in (rule.get("pairs") or {}).items()}
        for obj in acc:
            obj["metadata"].setdefault("labels", {}).update(pairs)
            spec = obj.get("spec", {})
            if rule.get("includeTemplates") and isinstance(spec.get("template"), dict):
                spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if rule.get("includeSelectors"):
                if isinstance(spec.get("selector"), dict):
                    spec["selector"].setdefault("matchLabels", {}).update(pairs)
                if isinstance(spec.get("template"), dict):
                    spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


# ---------------------------------------------------------------- build


def _build(root: Path) -> list[Obj]:
    """One kustomization level. Generated objects keep their original names (and markers) until
    `build` finalizes them, so overlays can merge into or replace a base's generated objects."""
    kfile = root / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    kust = yaml.load(kfile.read_text(), Loader=LOADER) or {}
    unknown = set(kust) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{kfile}: fields {sorted(unknown)} are outside the subset kustomize_lite renders")

    acc: list[Obj] = []
    for rel in kust.get("resources", []) or []:
        target = (root / rel).resolve()
        if not target.exists():
            raise KustomizeError(f"{kfile}: resource {rel!r} does not exist")
        acc.extend(_build(target) if target.is_dir() else _load_yaml_docs(_inside(root, rel, "resource")))

    _generate(root, kust, acc)
    acc = _apply_patches(root, kust, acc)
    if kust.get("namespace"):
        for obj in acc:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    _set_labels(acc, kust.get("labels", []) or [])
    _set_images(acc, kust.get("images", []) or [])

    seen: set[tuple[str, str, str]] = set()
    for obj in acc:
        ident = _ident(obj)
        if ident in seen:
            raise KustomizeError(f"{kfile}: {ident} is defined twice")
        seen.add(ident)
    return acc


def build(path: str | Path) -> list[Obj]:
    """Render a kustomization directory into its list of objects (like `kustomize build`)."""
    acc = _build(Path(path))
    renames = _finalize_names(acc)
    if renames:
        # Only built-in workloads: kustomize does not know where custom resources keep references.
        for obj in acc:
            if obj["kind"] in WORKLOAD_KINDS:
                _rewrite_refs(obj.get("spec", {}), renames)
    return acc


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kustomize_lite.py DIR", file=sys.stderr)
        return 2
    try:
        objs = build(argv[0])
    except KustomizeError as exc:
        print(f"kustomize_lite: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
