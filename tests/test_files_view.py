"""``files/``: every mount mirrors SOURCE byte for byte, so any loader can open the source files through it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open

from tests.helpers import MountFn, run
from tests.models import rich_arrays, sharded_arrays, write_numpy, write_sharded


def test_a_single_file_source(mount: MountFn, tmp_path: Path) -> None:
    source = write_numpy(str(tmp_path / "rich.safetensors"), rich_arrays(), metadata={"format": "pt"})
    mnt = mount(source)
    assert os.listdir(os.path.join(mnt, "files")) == ["rich.safetensors"]
    mirrored = os.path.join(mnt, "files", "rich.safetensors")
    assert run(["cmp", mirrored, source]).returncode == 0
    assert os.path.getsize(mirrored) == os.path.getsize(source)
    with safe_open(mirrored, "numpy") as loaded:  # the safetensors loader itself, through the mount
        assert sorted(loaded.keys()) == sorted(rich_arrays())
        for name, array in rich_arrays().items():
            assert np.array_equal(loaded.get_tensor(name), array)


def test_an_index_source_mirrors_the_index_and_its_shards(mount: MountFn, tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path / "set"), sharded_arrays())
    (tmp_path / "set" / "unrelated.txt").write_text("not named by the index\n")
    mnt = mount(index)
    names = sorted(os.listdir(os.path.join(mnt, "files")))
    assert names == sorted([os.path.basename(index), *sharded_arrays()])
    for name in names:
        assert run(["cmp", os.path.join(mnt, "files", name), str(tmp_path / "set" / name)]).returncode == 0


def test_a_folder_source_mirrors_every_regular_file(mount: MountFn, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_sharded(str(repo), sharded_arrays())
    (repo / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 8}))
    (repo / "tokenizer").mkdir()
    (repo / "tokenizer" / "vocab.txt").write_bytes(bytes(range(256)) * 10)
    (repo / "empty").write_bytes(b"")
    mnt = mount(str(repo))
    assert run(["diff", "-r", os.path.join(mnt, "files"), str(repo)]).returncode == 0  # same names, same bytes
    with open(os.path.join(mnt, "files", "config.json")) as stream:
        assert json.load(stream)["hidden_size"] == 8
    loaded = {}
    for shard in sharded_arrays():  # what from_pretrained does with MNT/files: open each shard lazily
        with safe_open(os.path.join(mnt, "files", shard), "numpy") as handle:
            loaded.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    expected = {name: array for arrays in sharded_arrays().values() for name, array in arrays.items()}
    assert sorted(loaded) == sorted(expected)
    assert all(np.array_equal(loaded[name], expected[name]) for name in expected)
    assert os.stat(os.path.join(mnt, "files", "tokenizer")).st_mode & 0o777 == 0o555
    assert os.stat(os.path.join(mnt, "files", "config.json")).st_mode & 0o777 == 0o444
