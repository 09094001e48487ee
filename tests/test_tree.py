"""Names to paths without a mount: escaping, collisions, implicit folders, lookup."""

from __future__ import annotations

import numpy as np
import pytest

from stfs.model import ModelSource, load
from stfs.nodes import DirNode, FileNode, tensor_xattrs
from stfs.tree import NAME_MAX, escape_component, join_path, split_name, unescape_component
from stfs.views import build_tree
from tests.models import WEIRD_NAMES, write_numpy


@pytest.mark.parametrize("name", WEIRD_NAMES)
def test_nested_split_round_trips(name: str) -> None:
    components = split_name(name, "nested")
    assert all(c and c not in (".", "..") and "/" not in c and "\x00" not in c for c in components)
    assert join_path(components) == name


@pytest.mark.parametrize("name", WEIRD_NAMES)
def test_flat_name_is_one_safe_component(name: str) -> None:
    (component,) = split_name(name, "flat")
    assert component not in (".", "..", "") and "/" not in component and "\x00" not in component
    assert unescape_component(component) == name


def test_escaping_examples() -> None:
    expected = ["model", "layers", "0", "mlp", "up_proj", "weight"]
    assert split_name("model.layers.0.mlp.up_proj.weight", "nested") == expected
    assert escape_component("x/y") == "x%2Fy"
    assert escape_component("100%") == "100%25"
    assert escape_component("nul\x00") == "nul%00"
    assert escape_component("..") == "%2E%2E"
    assert escape_component("") == "%"
    assert split_name("a..b", "nested") == ["a..b"]
    assert split_name(".a.b", "nested") == [".a", "b"]


def test_distinct_names_never_share_a_component() -> None:
    escaped = [split_name(name, "flat")[0] for name in WEIRD_NAMES]
    assert len(set(escaped)) == len(WEIRD_NAMES)


def test_long_component_is_shortened_below_name_max() -> None:
    long = "é" * 300
    component = escape_component(long)
    assert len(component.encode()) <= NAME_MAX
    assert "%~" in component
    assert escape_component(long + "x") != component


def weird_model(tmp_path) -> str:  # noqa: ANN001
    arrays = {name: np.full(i + 1, i, dtype=np.uint8) for i, name in enumerate(WEIRD_NAMES)}
    return write_numpy(str(tmp_path / "weird.safetensors"), arrays, metadata={"k/ey": "v", "": "empty", ".": "dot"})


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_every_weird_tensor_has_exactly_one_path(tmp_path, layout: str) -> None:  # noqa: ANN001
    path = weird_model(tmp_path)
    model = load(ModelSource(name="", path=path))
    tree = build_tree([model], layout)
    found: dict[str, list[str]] = {}
    for node_path, node in tree.walk():
        if isinstance(node, FileNode) and node_path.startswith("/tensors/"):
            name = tensor_xattrs(node)["user.safetensors.name"].decode()
            found.setdefault(name, []).append(node_path)
    assert sorted(found) == sorted(WEIRD_NAMES)
    assert all(len(paths) == 1 for paths in found.values())
    assert tree.lookup("/tensors/a/b/%" if layout == "nested" else "/tensors/a.b") is not None
    assert isinstance(tree.lookup("/tensors/%"), FileNode)  # the empty name


def test_metadata_keys_escaped(tmp_path) -> None:  # noqa: ANN001
    model = load(ModelSource(name="", path=weird_model(tmp_path)))
    tree = build_tree([model])
    assert sorted(tree.listdir("/metadata") or []) == ["%", "%2E", "k%2Fey"]


def test_lookup_misses_return_none(tmp_path) -> None:  # noqa: ANN001
    model = load(ModelSource(name="", path=weird_model(tmp_path)))
    tree = build_tree([model])
    assert tree.lookup("/nope") is None
    assert tree.listdir("/header.json") is None
    assert isinstance(tree.lookup("/tensors"), DirNode)


def test_inodes_are_stable_and_unique(tmp_path) -> None:  # noqa: ANN001
    model = load(ModelSource(name="", path=weird_model(tmp_path)))
    first = {path: node.inode for path, node in build_tree([model]).walk()}
    second = {path: node.inode for path, node in build_tree([model]).walk()}
    assert first == second
    assert len(set(first.values())) == len(first)
