"""Rendering deploy/kubernetes with kustomize, or, where no kustomize binary exists, with
a small Python stand-in limited to what those manifests use: `resources` (files and
directories), `images` (newName/newTag) and `patches` given by `path` (strategic merge
patches matched by kind and name; lists of containers, volumes, ports and volume mounts
merge by their keys, the patch's elements first, and every other list is replaced, as
kustomize does for these fields).
It is not kustomize: test_kubernetes.py checks both render the same where the binary
is present, and the tests say which one rendered."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

# Lists merged element by element in a strategic merge patch, by the element's key.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
              "ports": "containerPort", "volumeMounts": "mountPath", "env": "name"}


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def build_with_binary(directory: Path) -> list[dict[str, Any]]:
    command = kustomize_command()
    assert command is not None
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def build(directory: Path) -> list[dict[str, Any]]:
    """The Python stand-in: the documents a kustomization directory renders to."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        docs += build(path) if path.is_dir() else _load(path)
    for patch in spec.get("patches", []):
        for p in _load(directory / patch["path"]):
            target = _find(docs, p["kind"], p["metadata"]["name"])
            merged = _merge(target, p)
            target.clear()
            target.update(merged)
    for image in spec.get("images", []):
        for doc in docs:
            _set_images(doc, image)
    return docs


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if len(found) != 1:
        raise ValueError(f"a patch targets {kind}/{name}, found {len(found)}")
    return found[0]


def _merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        # kustomize's order: the patch's elements (merged into the base's of the same
        # key), then the base's elements the patch does not name.
        key = MERGE_KEYS[field]
        named = {item.get(key) for item in patch}
        out = []
        for item in patch:
            match = next((b for b in base if b.get(key) == item.get(key)), None)
            out.append(copy.deepcopy(item) if match is None else _merge(match, item))
        return out + [copy.deepcopy(b) for b in base if b.get(key) not in named]
    return copy.deepcopy(patch)


def _set_images(node: Any, image: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str) and value.split(":")[0] == image["name"]:
                name = image.get("newName", image["name"])
                tag = image.get("newTag", value.partition(":")[2])
                node[key] = f"{name}:{tag}" if tag else name
            else:
                _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)
