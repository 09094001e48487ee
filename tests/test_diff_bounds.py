"""What ``stfs diff`` and ``stfs check --values`` promise whatever the size (SPEC §10): memory bounded while models
far larger are read, and a progress bar only on a terminal."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.helpers import REPO, on_a_terminal
from tests.torch_models import write

MIB = 1 << 20
GROWTH = 256 * MIB  # SPEC §10: the process's memory grows by at most this much


def sparse_model(path: Path, tensors: int, tensor_bytes: int, values: dict[int, float] | None = None) -> str:
    """F32 tensors of zeros, written sparsely (cheap however large), with ``values`` (data offset -> float) set."""
    header = {
        f"layers.{i}.weight": {
            "dtype": "F32",
            "shape": [tensor_bytes // 4],
            "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes],
        }
        for i in range(tensors)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)) + raw)
        stream.truncate(8 + len(raw) + tensors * tensor_bytes)
        for offset, value in (values or {}).items():
            stream.seek(8 + len(raw) + offset)
            stream.write(struct.pack("<f", value))
    return str(path)


MEASURE = textwrap.dedent(
    """
    import sys
    from stfs.cli import main
    import stfs.diff, stfs.scan, numpy  # what the command imports, before the baseline is taken

    def status(name):
        with open("/proc/self/status") as stream:
            return next(int(line.split()[1]) * 1024 for line in stream if line.startswith(name + ":"))

    before = status("VmRSS")
    code = main(sys.argv[1:])
    print("MEASURED", code, before, status("VmHWM"), file=sys.stderr)
    """
)


def peak_growth(*argv: str) -> tuple[int, int]:
    """Run the command in a process of its own: its exit code, and how far its peak RSS rose above its RSS once
    everything was imported."""
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    line = next(line for line in result.stderr.splitlines() if line.startswith("MEASURED"))
    code, before, peak = map(int, line.split()[1:])
    return code, peak - before


def test_memory_stays_bounded_while_models_far_larger_are_compared(tmp_path: Path) -> None:
    size = 256 * MIB
    a = sparse_model(tmp_path / "a.safetensors", 4, size)  # 1 GiB a side
    # B differs early in each tensor (every later chunk is decoded for ‖a‖), late in one (its equal start read again)
    changes = {i * size + 4096 * (i + 1): float(i + 1) for i in range(3)} | {4 * size - 8: -1.0}
    b = sparse_model(tmp_path / "b.safetensors", 4, size, changes)
    code, growth = peak_growth("diff", "--json", a, b)
    assert code == 1
    assert growth <= GROWTH, f"grew by {growth / MIB:.0f} MiB"
    code, growth = peak_growth("check", "--values", b)
    assert code == 0
    assert growth <= GROWTH, f"grew by {growth / MIB:.0f} MiB"


def test_a_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    a = write(tmp_path / "a.safetensors", {"w": torch.zeros(4 * MIB)})
    b = write(tmp_path / "b.safetensors", {"w": torch.ones(4 * MIB)})
    code, terminal, stdout = on_a_terminal("diff", a, b)
    assert code == 1 and stdout.startswith("~ w  F32")
    assert b"comparing" in terminal and b"%" in terminal and b"32.0M" in terminal  # bytes of the total: both sides
    code, terminal, _ = on_a_terminal("diff", "--quiet", a, b)
    assert (code, terminal) == (1, b"")
    code, terminal, stdout = on_a_terminal("check", "--values", a)
    assert code == 0 and b"checking values" in terminal
    code, terminal, _ = on_a_terminal("check", "--values", "-q", a)
    assert (code, terminal) == (0, b"")
    off = subprocess.run([sys.executable, "-m", "stfs", "diff", a, b], cwd=REPO, capture_output=True, timeout=60)
    assert (off.returncode, off.stderr) == (1, b"")
