"""What the CSI plugin's container holds in memory (docs/kubernetes.md, Memory): one volume's daemon by its cache.

A 256 MiB model (64 tensors of 4 MiB, random float32) behind nginx (tests/servers.py's ``Nginx``), mounted over
HTTP with ``--cache-size 64M`` and ``256M`` and read whole with ``cat``; the same model mounted from a local file;
``stfs csi`` itself, idle. Each figure is the process's RssAnon + RssShmem (the memfd cache's pages), as
benchmarks/bench_remote.py's memory row: what the container's memory limit is charged for each.

    python3 benchmarks/bench_csi_memory.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import MIB, environment, log, resident, stfs_command  # noqa: E402
from stfs.daemon import daemon_pid  # noqa: E402
from tests.servers import Nginx  # noqa: E402


def write_model(path: Path) -> None:
    import numpy
    from safetensors.numpy import save_file

    rng = numpy.random.default_rng(0)
    save_file({f"t{i}": rng.standard_normal((1024, 1024), dtype=numpy.float32) for i in range(64)}, str(path))


def daemon_memory(source: str, mountpoint: Path, *options: str) -> int:
    """The daemon's RssAnon + RssShmem once ``cat`` has read every byte of ``files/`` through it."""
    mountpoint.mkdir()
    subprocess.run(stfs_command("mount", *options, source, str(mountpoint)), check=True, env=environment())
    try:
        pid = daemon_pid(str(mountpoint))
        assert pid is not None
        for path in sorted((mountpoint / "files").iterdir()):
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
        return resident(pid, shared=True)
    finally:
        subprocess.run(stfs_command("unmount", str(mountpoint)), check=True, env=environment())


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="stfs-bench-csi-"))
    nginx = Nginx(work / "nginx")
    nginx.start()
    try:
        model = work / "model.safetensors"
        write_model(model)
        url = nginx.put("model.safetensors", model.read_bytes())
        log(f"load {os.getloadavg()[0]:.1f}")
        for cache in ("64M", "256M"):
            used = daemon_memory(url, work / f"mnt-{cache}", "--cache-size", cache)
            print(f"remote, --cache-size {cache}: daemon {used / MIB:.0f} MiB")
        print(f"local: daemon {daemon_memory(str(model), work / 'mnt-local') / MIB:.0f} MiB")
        socket = work / "csi.sock"
        command = stfs_command("csi", "--endpoint", f"unix://{socket}", "--node-id", "n", "--state-dir", str(work))
        plugin = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=environment())
        try:
            deadline = time.monotonic() + 60
            while not socket.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1)
            print(f"stfs csi, idle: {resident(plugin.pid, shared=True) / MIB:.0f} MiB")
        finally:
            plugin.terminate()
            plugin.wait()
    finally:
        nginx.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
