#!/usr/bin/env python3
"""Write a small Q4_K GGUF (one block of one tensor broken on purpose), mount it with stfs, find its tensors,
its NaNs and a heatmap with ordinary tools, unmount.

Usage: python3 scripts/demo_gguf.py [WORKDIR]   (default: a new temporary folder)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

Q4_K = GGMLQuantizationType.Q4_K


def q4_k_blocks(rows: int, columns: int, seed: int) -> np.ndarray:
    """Q4_K blocks of random 4-bit values whose scales are small and finite (gguf-py cannot quantize to Q4_K)."""
    block, size = GGML_QUANT_SIZES[Q4_K]
    blocks = np.random.default_rng(seed).integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
    blocks[:, :4] = np.frombuffer(np.array([0.002, 0.001], dtype="<f2").tobytes(), dtype=np.uint8)  # d, dmin
    return blocks.reshape(rows, -1)


def write_sample(folder: str) -> str:
    """A tiny llama-shaped GGUF: F32 norms, Q4_K matrices, one of which holds a block whose scale is NaN."""
    path = os.path.join(folder, "tiny-Q4_K.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", q4_k_blocks(512, 256, 0), raw_dtype=Q4_K)
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(256, dtype=np.float32))
        broken = q4_k_blocks(256, 256, layer + 1)
        if layer == 1:
            broken[3, :2] = np.frombuffer(np.array([np.nan], dtype="<f2").tobytes(), dtype=np.uint8)
        writer.add_tensor(f"blk.{layer}.attn_q.weight", broken, raw_dtype=Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def show(command: str) -> None:
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=False)


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="stfs-gguf-demo-")
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    write_sample(folder)
    os.makedirs("mnt", exist_ok=True)
    show("stfs info tiny-Q4_K.gguf | tail -4")
    show("stfs mount tiny-Q4_K.gguf mnt --view stats --view png")
    show("ls mnt mnt/tensors/blk/1")
    show("getfattr -d mnt/tensors/blk/1/attn_q/weight")
    show("cat mnt/metadata/llama.attention.layer_norm_rms_epsilon")
    show("grep -l '\"nan\": [1-9]' -r mnt/stats")
    show("jq -c '{nan, finite, min, max}' mnt/stats/blk/1/attn_q/weight.json")
    show("file mnt/png/blk/1/attn_q/weight.png")
    show("stfs unmount mnt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
