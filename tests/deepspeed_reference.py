"""DeepSpeed's own tools on ZeRO run folders, for tests/test_deepspeed.py to compare with (run with deepspeed
installed, in a process of its own):

* ``python deepspeed_reference.py fp32 RUN OUT [RUN OUT ...]`` writes ``OUT/fp32.pt``, the state dict of
  ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(RUN)`` (each tensor made contiguous), and
  ``OUT/version``, DeepSpeed's version, and ``OUT/universal/``, what ``ds_to_universal`` makes of its
  ``global_step2`` (``zero/NAME/exp_avg.pt``, ...);
* ``python deepspeed_reference.py shorten FILE`` rewrites a rank's optimizer state with its first flat partition
  50 elements short; ``... stage FILE N`` with its ZeRO stage N (DeepSpeed's own enum, as DeepSpeed pickles it);
  ``... groups FILE`` with a second parameter group (a copy of its first flat partition).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402


def fp32(pairs: list[str]) -> None:
    for run, out in zip(pairs[::2], pairs[1::2], strict=True):
        os.makedirs(out, exist_ok=True)
        state = get_fp32_state_dict_from_zero_checkpoint(run)
        torch.save({name: tensor.contiguous() for name, tensor in state.items()}, os.path.join(out, "fp32.pt"))
        with open(os.path.join(out, "version"), "w") as stream:
            stream.write(deepspeed.__version__)
        universal = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(run, "global_step2"),
            "--output_folder",
            os.path.join(out, "universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ]
        subprocess.run(universal, check=True, stdout=subprocess.DEVNULL)


def mutate(what: str, file: str, value: str | None) -> None:
    state = torch.load(file, weights_only=False)
    optimizer = state["optimizer_state_dict"]
    key = "fp32_flat_groups" if "fp32_flat_groups" in optimizer else "single_partition_of_fp32_groups"
    if what == "shorten":
        optimizer[key][0] = optimizer[key][0][:-50].clone()
    elif what == "groups":
        optimizer[key].append(optimizer[key][0].clone())
    else:
        optimizer["zero_stage"] = ZeroStageEnum(int(value or 0))
    torch.save(state, file)


if __name__ == "__main__":
    if sys.argv[1] == "fp32":
        fp32(sys.argv[2:])
    else:
        mutate(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
