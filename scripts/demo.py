#!/usr/bin/env python3
"""Write a small sample model, mount it with stfs, look inside with ordinary tools, unmount.

Usage: python3 scripts/demo.py [WORKDIR]   (default: a new temporary folder, removed at the end)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file


def write_sample(folder: str) -> str:
    """A two-shard model shaped like a tiny transformer, with an index, as a Hugging Face repo holds it."""
    rng = np.random.default_rng(0)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": rng.standard_normal((1000, 64)).astype(np.float16),
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((64, 64)).astype(np.float16),
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((256, 64)).astype(np.float32),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.1.self_attn.q_proj.weight": rng.standard_normal((64, 64)).astype(np.float16),
            "model.layers.1.mlp.up_proj.weight": rng.standard_normal((256, 64)).astype(np.float32),
            "model.norm.weight": np.ones(64, dtype=np.float32),
        },
    }
    weight_map = {}
    for shard, arrays in shards.items():
        save_file(arrays, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, shard))
    total = sum(a.nbytes for arrays in shards.values() for a in arrays.values())
    import json

    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as stream:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, stream, indent=2)
    return folder


def show(command: str) -> None:
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=False)


def main() -> int:
    if len(sys.argv) > 1:
        return demo(sys.argv[1])
    work = tempfile.mkdtemp(prefix="stfs-demo-")
    start = os.getcwd()
    try:
        return demo(work)
    finally:
        os.chdir(start)
        if os.path.ismount(os.path.join(work, "mnt")):  # removing it would walk the mount: left, and said where
            print(f"{work}/mnt is still mounted: stfs unmount it, then remove {work}", file=sys.stderr)
        else:
            shutil.rmtree(work)


def demo(work: str) -> int:
    """The example in ``work``: its model, then the mount at ``work/mnt``."""
    model = os.path.join(work, "model")
    mnt = os.path.join(work, "mnt")
    os.makedirs(model, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    write_sample(model)
    os.chdir(work)
    show("stfs info model | tail -5")
    show("stfs mount model mnt")
    try:
        show("ls mnt mnt/tensors/model/layers/0/mlp")
        show("hexdump -C -n 32 mnt/tensors/model/norm/weight")
        show("getfattr -d mnt/tensors/model/layers/0/mlp/up_proj/weight")
        show("jq -c '.[\"model.norm.weight\"]' mnt/header.json")
        show(
            "python3 -c \"import numpy as np; a = np.memmap('mnt/tensors/model/layers/1/mlp/up_proj/weight', "
            "dtype=np.float32, mode='r', shape=(256, 64)); print(a.shape, float(a.sum()))\""
        )
        show("du -sh --apparent-size mnt/tensors; df -h mnt | tail -1")
    finally:
        show("stfs unmount mnt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
