"""A DeepSpeed ZeRO-2 checkpoint of given arrays, as ``engine.save_checkpoint`` writes it from one rank, for the
format contract (tests/test_format_contract.py): ``python deepspeed_write.py ARRAYS.npz OUT`` (with torch.distributed's
environment for one rank) writes ``OUT/latest`` and ``OUT/contract/``. Float32 arrays are the model's trained
parameters (what the checkpoint holds of them is their float32 master copies), the others its buffers (kept in their
own dtype); a dotted name is a parameter of nested modules."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]  # gloo only, no JIT


def module_of(arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, array in arrays.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        value = torch.from_numpy(np.ascontiguousarray(array))
        if array.dtype == np.float32:
            owner.register_parameter(leaf, torch.nn.Parameter(value))
        else:
            owner.register_buffer(leaf, value)
    return root


def main(npz: str, out: str) -> None:
    with np.load(npz) as loaded:
        arrays = {name: loaded[name] for name in loaded.files}
    model = module_of(arrays)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.save_checkpoint(out, tag="contract")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
