"""Models written with torch tensors by the real safetensors (``safetensors.torch.save_file``): BF16 and F8, which
NumPy cannot hold, beside the other dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

Tensors = dict[str, torch.Tensor]


def model(seed: int = 0) -> Tensors:
    """Nine tensors of every kind stfs diff tells apart: F32, BF16, F16, F8, F64, I64, BOOL, a scalar, an empty one."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=generator),
        "model.layers.0.attn.q.weight": torch.randn(32, 32, generator=generator).to(torch.bfloat16),
        "model.layers.0.mlp.up.weight": torch.randn(48, 32, generator=generator).to(torch.float16),
        "model.layers.0.fp8.weight": torch.randn(16, 16, generator=generator).to(torch.float8_e4m3fn),
        "model.norm.bias": torch.randn(32, generator=generator).double(),
        "model.positions": torch.arange(100, dtype=torch.int64),
        "model.mask": torch.arange(12) % 3 == 0,
        "model.scalar": torch.tensor(2.5),
        "model.empty": torch.zeros(0, 4),
    }


def write(path: Path, tensors: Tensors) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    return str(path)


def write_shards(folder: Path, tensors: Tensors, shards: int = 3) -> str:
    """The tensors as a sharded set of ``shards`` files (round robin) and its index; the index's path."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[k::shards]}
        write(folder / shard, part)
        weight_map |= dict.fromkeys(part, shard)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(index)
