"""The daemon's CPU per remote GB, next to curl's: what a byte fetched over the network costs stfs.

A model of 128 MiB tensors (1 GiB by default, ``--size-mib``; random bytes) behind nginx on 127.0.0.1
(tests/servers.py's ``Nginx``; the file read once first, so nginx serves it from the page cache), over HTTP and
HTTPS (the tests' own CA: ``curl --cacert``, the daemon's ``SSL_CERT_FILE``). Each round, each case, side by side:

  curl     ``curl -o /dev/null URL``: the whole file in one GET; GB/s, and CPU-seconds per GB of curl (user +
           system from /proc/PID/stat, read once it has exited and before it is reaped); before and after the
           stfs reads, the mean of the two
  stfs     ``dd if=MNT/files/MODEL of=/dev/null bs=1M`` on a fresh mount of the URL; GB/s, the daemon's CPU-seconds
           per GB (/proc/PID/stat before and after the read, the mount settled first: nothing running), split
           between its threads that fetch (``stfs-fetch``) and the rest (libfuse's, answering reads), and dd's (the
           kernel's copy out of the mount's page cache)

and behind a link capped at 50 MB/s a connection (nginx ``limit_rate``, ``/capped/``), the case of object stores
and registry CDNs: curl of one 128 MiB tensor against ``dd`` of ``tensors/t2`` and of ``files/MODEL`` on fresh
mounts (curl's rate is the cap whatever it reads, so the whole model is not fetched by curl: 20 s a GiB).

Before each read (curl's and stfs's), 2 GiB of new memory is written once and freed (``touch_memory``): in a VM
whose host takes freed memory back, the first write to such a page faults at the host too (3 CPU-s per GB here
against 0.7 once it is back), and the mount's page cache takes new pages where curl to /dev/null takes none, so a
cold round charges the daemon for the host (``--cold`` measures that way). ``--local`` adds ``dd`` of the same file
mounted from disk: what FUSE's page cache alone costs the daemon. ``--checkout NAME=PATH`` (repeated) runs each
checkout's stfs in every round, their order flipped round by round, against the same curl runs. The cases
``fetch-http`` and ``fetch-https`` time the fetch side alone: the model as stfs's 8 MiB GETs, eight threads at a
time, through its HTTP client into reused buffers, in a process of its own (no FUSE, no page cache). ``splice-http``
makes the same GETs (``http.client`` reads the headers) but moves each body out of its socket by ``splice`` into a
1 MiB pipe, 1008 KiB at a time (a FUSE reply's bytes), emptied into /dev/null: what a daemon that answered reads
from the socket, with no buffer of its own between, would pay to receive; and the fewest bytes the pipe held when it
refused more from the socket (a pipe buffer per fragment of the socket's data, 256 of them in 1 MiB).

Around each read, nginx's CPU-seconds (its master and workers) and the cores busy on the whole machine (/proc/stat:
other users' work included) are taken too: the read path's CPU per GB (curl + nginx; the daemon + dd + nginx) says
what a read costs the machine, and where every core is busy, the rates follow those costs, not the pipelines.

The load (/proc/loadavg) is printed with every figure: the machine is shared. CPU-seconds per GB moves less with
the load than GB/s does. ``--perf PREFIX`` records the daemon during the first round's reads (``perf record -g -p
PID``, into PREFIX.CASE.CHECKOUT); ``perf report -i FILE --no-children --sort sym`` shows where its time goes.

    python3 benchmarks/bench_cpu.py --rounds 5 [--size-mib 1024] [--cases http,https,capped] [--local]
        [--checkout before=DIR --checkout after=.] [--perf /tmp/perf]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.benchlib import (  # noqa: E402
    MIB,
    STFS_REPO,
    Mount,
    cpu_seconds,
    environment,
    log,
    random_fill,
    warm,
    write_model,
)
from tests.servers import CAPPED_RATE, Nginx, make_tls  # noqa: E402

TENSOR_BYTES = 128 * MIB
CAPPED_TENSOR = "t2"  # the tensor read alone behind the cap (the second if the model has fewer)
TARGETS = {"cpu": 2.0, "rate": 0.8, "capped_tensor": 4.0, "capped_model": 6.0}  # issue #53


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def server_cpu(nginx: Nginx) -> float:
    """User + system CPU-seconds of nginx so far: its master and workers (the processes whose parent it is)."""
    master = nginx.pid if nginx.pid is not None else -1
    total = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stream:
                parent = int(stream.read().rpartition(")")[2].split()[1])
            if int(name) == master or parent == master:
                total += cpu_seconds(int(name))
        except (OSError, ValueError):  # gone meanwhile
            continue
    return total


@contextlib.contextmanager
def watched(nginx: Nginx, figures: dict[str, float]) -> Iterator[None]:
    """nginx's CPU-seconds and the cores busy (of all the machine's, from /proc/stat: other users' work included)
    while the block runs, into ``figures`` as ``server_cpu`` and ``busy_cores``."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as stream:
            values = [int(v) for v in stream.readline().split()[1:9]]  # past steal: guest time, counted in user
        return sum(values), values[3] + values[4]  # all, idle + iowait

    server, (total, idle) = server_cpu(nginx), ticks()
    yield
    after_total, after_idle = ticks()
    figures["server_cpu"] = server_cpu(nginx) - server
    spent = max(1, after_total - total)
    figures["busy_cores"] = (os.cpu_count() or 1) * (1 - (after_idle - idle) / spent)


def finished_cpu(process: subprocess.Popen) -> float:
    """User + system CPU-seconds of ``process`` once it has exited (read from /proc/PID/stat before it is
    reaped); it must have exited with status 0."""
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    used = cpu_seconds(process.pid)
    if process.wait() != 0:
        raise RuntimeError(f"{process.args!r} failed: {process.stderr.read() if process.stderr else ''}")
    return used


def timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU-seconds of ``command``, its output thrown away."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    used = finished_cpu(process)
    return time.perf_counter() - started, used


def curl(url: str, extra: list[str], byte_range: tuple[int, int] | None = None) -> tuple[float, float]:
    command = ["curl", "-sS", "--noproxy", "*", "-o", "/dev/null", *extra, url]
    if byte_range is not None:
        command[1:1] = ["-r", f"{byte_range[0]}-{byte_range[1] - 1}"]
    return timed(command)


def settled(pid: int, quiet: float = 0.3, limit: float = 20.0) -> float:
    """The CPU-seconds of process ``pid`` once it has used none for ``quiet`` seconds (a mount faults its first
    slots in, in the background): what a read's cost is counted from."""
    deadline = time.monotonic() + limit
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = cpu_seconds(pid)
        if now == last:
            return now
        last = now
    return last


@contextlib.contextmanager
def recorded(pid: int, path: str | None) -> Iterator[None]:
    """``perf record -g -p PID -o PATH`` while the block runs (nothing without ``path``)."""
    if path is None:
        yield
        return
    perf = subprocess.Popen(
        ["perf", "record", "-g", "-p", str(pid), "-o", path],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)  # perf attaches to every thread first
    try:
        yield
    finally:
        perf.send_signal(2)
        perf.wait(timeout=60)


def touch_memory(size: int) -> float:
    """Write one byte a page of ``size`` bytes of new anonymous memory, then free it; GB/s of those first writes.
    In a VM whose host takes freed memory back, a page the guest hands out for the first time in a while faults in
    at the host too (0.3 GB/s here, against 1.5 when it is still there): the mount's page cache takes such pages,
    curl to /dev/null none. Done before each read (but with ``--cold``), so that the figures are stfs's own."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        began = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            memory[offset] = 1
        return size / (time.perf_counter() - began) / 1e9
    finally:
        memory.close()


def read_through_mount(
    url: str,
    mnt: str,
    path: str,
    size: int,
    perf: str | None = None,
    warm_memory: bool = True,
    nginx: Nginx | None = None,
) -> dict[str, float]:
    """``dd`` of ``path`` (relative to the mount) on a fresh mount of ``url``: GB/s, the daemon's and dd's
    CPU-seconds per GB; given ``nginx``, its CPU-seconds per GB and the machine's cores busy meanwhile too."""
    watch: dict[str, float] = {}
    with Mount(url, mnt) as mount:
        before = settled(mount.pid)
        fetching = threads_cpu(mount.pid, "stfs-fetch")
        if warm_memory:
            touch_memory(size * 2)
        with recorded(mount.pid, perf), watched(nginx, watch) if nginx else contextlib.nullcontext():
            seconds, dd_cpu = timed(["dd", f"if={os.path.join(mnt, path)}", "of=/dev/null", "bs=1M"])
        daemon = cpu_seconds(mount.pid) - before
        fetching = threads_cpu(mount.pid, "stfs-fetch") - fetching
    gb = size / 1e9
    figures = {"gbs": gb / seconds, "daemon_cpu": daemon / gb, "dd_cpu": dd_cpu / gb, "fetch_cpu": fetching / gb}
    if nginx is not None:
        figures.update(server_cpu=watch["server_cpu"] / gb, busy_cores=watch["busy_cores"])
        figures["path_cpu"] = figures["daemon_cpu"] + figures["dd_cpu"] + figures["server_cpu"]
    return figures


def threads_cpu(pid: int, name: str) -> float:
    """User + system CPU time so far of the threads of process ``pid`` the kernel names ``name`` (the daemon names
    its fetching threads ``stfs-fetch``; they live as long as it does)."""
    total = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        # /proc/TID/stat would be the whole process's times: the thread's own are under task/
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as stream:  # ended meanwhile
            if stream.read().strip() == name:
                total += cpu_seconds(pid, f"task/{task}/stat")
    return total


FETCH_BLOCK = 8 * MIB  # stfs's block: the GETs of its readahead
FETCH_THREADS = 8  # as many as its window holds


def fetch_child(url: str, size: int, tree: str, spliced: bool = False) -> None:
    """In a process of its own (``--fetch-child URL --fetch-tree TREE``): ``size`` bytes of ``url`` as
    ``FETCH_BLOCK`` ranged GETs by ``FETCH_THREADS`` threads through the HTTP client of the checkout ``tree``'s stfs
    into 16 reused slots (``spliced``: ``splice_bodies`` instead); prints this process's CPU-seconds per GB and
    GB/s."""
    if spliced:
        return splice_bodies(url, size)
    import resource
    from concurrent.futures import ThreadPoolExecutor

    for name in [name for name in sys.modules if name == "stfs" or name.startswith("stfs.")]:
        del sys.modules[name]  # benchlib imported this checkout's: the other one's is wanted
    sys.path.insert(0, tree)
    from stfs.sources.http_client import HttpClient

    assert str(sys.modules["stfs"].__file__).startswith(os.path.join(tree, "")), "the other checkout's stfs"

    base, _, path = url.partition("://")[2].partition("/")
    client = HttpClient(url.split("://")[0] + "://" + base, {}, timeout=30.0)
    slots = memoryview(mmap.mmap(-1, 16 * FETCH_BLOCK))
    slots[:] = bytes(len(slots))  # the slots' pages faulted in before the clock starts, as a mount's are

    def one(block: int) -> None:
        slot = slots[(block % 16) * FETCH_BLOCK :][:FETCH_BLOCK]
        client.get_into(path, block * FETCH_BLOCK, slot[: min(FETCH_BLOCK, size - block * FETCH_BLOCK)])

    one(0)  # the first connection made and the TLS context loaded before the clock starts
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with ThreadPoolExecutor(FETCH_THREADS) as pool:
        list(pool.map(one, range(-(-size // FETCH_BLOCK))))
    after, seconds = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    client.close()
    print(json.dumps({"cpu": used / (size / 1e9), "gbs": size / seconds / 1e9}))


REPLY = 1008 * 1024  # the bytes of a FUSE read the daemon answers (max_read: a 1 MiB pipe and libfuse's header)
SPLICE_F_NONBLOCK = 2


def splice_bodies(url: str, size: int) -> None:
    """``fetch_child``'s GETs, each body moved from its socket into a 1 MiB pipe by ``splice`` (no copy: the pipe
    holds the socket's pages), ``REPLY`` bytes at a time, then out to /dev/null; prints CPU-seconds per GB, GB/s
    and ``pipe_held``: the fewest bytes a pipe held when it refused more while the socket had some."""
    import http.client
    import resource
    import select
    import threading
    from concurrent.futures import ThreadPoolExecutor

    host, _, path = url.partition("://")[2].partition("/")
    local = threading.local()
    held_when_full = [REPLY]
    null = os.open(os.devnull, os.O_WRONLY)

    def one(block: int) -> None:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection(host, timeout=None)
            local.pipe = os.pipe2(os.O_NONBLOCK)
            fcntl.fcntl(local.pipe[1], fcntl.F_SETPIPE_SZ, MIB)
        reader, writer = local.pipe
        lo = block * FETCH_BLOCK
        length = min(FETCH_BLOCK, size - lo)
        local.connection.request("GET", "/" + path, headers={"Range": f"bytes={lo}-{lo + length - 1}"})
        response = local.connection.getresponse()
        assert response.status == 206, response.status
        left = length - len(response.read(min(length, len(response.fp.peek()))))  # read with the headers
        sock = local.connection.sock
        while left:
            want, moved = min(REPLY, left), 0
            while moved < want:
                select.select([sock], [], [])
                try:
                    moved += os.splice(sock.fileno(), writer, want - moved, flags=SPLICE_F_NONBLOCK)
                except BlockingIOError:  # the socket has bytes (select said so): the pipe is full
                    held_when_full[0] = min(held_when_full[0], moved)
                    break
            out = 0
            while out < moved:
                out += os.splice(reader, null, moved - out)
            left -= moved
        response.length = 0  # http.client ends the response, the connection kept
        response.read()

    one(0)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with ThreadPoolExecutor(FETCH_THREADS) as pool:
        list(pool.map(one, range(-(-size // FETCH_BLOCK))))
    after, seconds = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    print(json.dumps({"cpu": used / (size / 1e9), "gbs": size / seconds / 1e9, "pipe_held": held_when_full[0]}))


def fetch_side(tree: str, url: str, size: int, spliced: bool = False) -> dict[str, float]:
    """``fetch_child`` with the checkout ``tree``'s stfs: the fetch side of a read alone, no FUSE."""
    command = [sys.executable, os.path.abspath(__file__), "--fetch-child", url, "--fetch-tree", tree]
    command += ["--size-mib", str(size // MIB)] + (["--fetch-spliced"] if spliced else [])
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), check=True, cwd=tree)
    figures: dict[str, float] = json.loads(result.stdout.splitlines()[-1])
    return figures


def one_round(
    number: int, nginx: Nginx, tls_bundle: str, model: str, size: int, spans: dict[str, tuple[int, int]], args: Any
) -> dict[str, Any]:
    """Every case of ``args.cases``, each checkout's reads after curl's (their order flipped every round)."""
    mnt = os.path.join(args.data, "mnt")
    checkouts = args.checkouts if number % 2 == 0 else args.checkouts[::-1]
    out: dict[str, Any] = {}
    for case in args.cases:
        figures: dict[str, Any] = {"load_before": load()}
        if case in ("http", "https"):
            base = nginx.url if case == "http" else nginx.https_url
            extra = ["--cacert", tls_bundle] if case == "https" else []
            url = f"{base}/{model}"
            if not args.cold:
                figures["fresh_memory_gbs"] = touch_memory(2 * size)
            curl_watch: list[dict[str, float]] = [{}, {}]
            with watched(nginx, curl_watch[0]):
                first = curl(url, extra)
            reads = {}
            for name, path in checkouts:
                STFS_REPO[0] = path
                perf = f"{args.perf}.{case}.{name}" if args.perf and number == 0 else None
                reads[name] = read_through_mount(
                    url, mnt, os.path.join("files", model), size, perf, not args.cold, nginx
                )
                if case == "http" and args.local:  # the file mounted from disk: what FUSE's page cache costs alone
                    local = read_through_mount(
                        str(nginx.root / model), mnt, f"files/{model}", size, None, not args.cold
                    )
                    figures.update({f"{name}_local_{k}": v for k, v in local.items()})
            if not args.cold:
                touch_memory(2 * size)
            with watched(nginx, curl_watch[1]):
                last = curl(url, extra)  # curl before and after stfs, their mean: the machine drifts meanwhile
            figures["curl_gbs"] = statistics.mean(size / seconds / 1e9 for seconds, _ in (first, last))
            figures["curl_cpu"] = statistics.mean(used / (size / 1e9) for _, used in (first, last))
            figures["curl_server_cpu"] = statistics.mean(w["server_cpu"] / (size / 1e9) for w in curl_watch)
            figures["curl_busy_cores"] = statistics.mean(w["busy_cores"] for w in curl_watch)
            figures["curl_path_cpu"] = figures["curl_cpu"] + figures["curl_server_cpu"]
            for name, stfs in reads.items():
                figures.update({f"{name}_{k}": v for k, v in stfs.items()})
                figures[f"{name}_cpu_vs_curl"] = stfs["daemon_cpu"] / figures["curl_cpu"]
                figures[f"{name}_rate_vs_curl"] = stfs["gbs"] / figures["curl_gbs"]
                figures[f"{name}_path_vs_curl"] = stfs["path_cpu"] / figures["curl_path_cpu"]
        elif case in ("fetch-http", "fetch-https", "splice-http"):
            base = nginx.https_url if case == "fetch-https" else nginx.url
            for name, path in checkouts:
                fetched = fetch_side(path, f"{base}/{model}", size, spliced=case == "splice-http")
                figures[f"{name}_fetch_cpu"], figures[f"{name}_fetch_gbs"] = fetched["cpu"], fetched["gbs"]
                if "pipe_held" in fetched:
                    figures[f"{name}_pipe_held_kib"] = fetched["pipe_held"] / 1024
        else:
            url = f"{nginx.url}/capped/{model}"
            tensor = CAPPED_TENSOR if CAPPED_TENSOR in spans else sorted(spans)[-1]
            lo, hi = spans[tensor]
            seconds, _ = curl(url, [], (lo, hi))
            figures["curl_gbs"] = (hi - lo) / seconds / 1e9
            for name, path in checkouts:
                STFS_REPO[0] = path
                one = read_through_mount(url, mnt, os.path.join("tensors", tensor), hi - lo)
                whole = read_through_mount(url, mnt, os.path.join("files", model), size)
                figures[f"{name}_tensor_gbs"], figures[f"{name}_model_gbs"] = one["gbs"], whole["gbs"]
                figures[f"{name}_tensor_vs_curl"] = one["gbs"] / figures["curl_gbs"]
                figures[f"{name}_model_vs_curl"] = whole["gbs"] / figures["curl_gbs"]
        figures["load_after"] = load()
        log(f"{case}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))
        out[case] = figures
    return out


def the_model(root: Path, size: int) -> tuple[str, dict[str, tuple[int, int]]]:
    """A model of ``size`` bytes under ``root`` in tensors of 128 MiB (eight of ``size / 8`` if smaller), written
    once; its name and each tensor's span in the file."""
    each = TENSOR_BYTES if size >= TENSOR_BYTES else max(MIB, size // 8)
    count = max(1, size // each)
    name = f"model-{count}x{each // MIB}M.safetensors"
    path = root / name
    if not path.exists():
        log(f"writing {path}")
        write_model(str(path), [(f"t{i}", "U8", [each], each) for i in range(count)], random_fill(53))
    with open(path, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(length))
    base = 8 + length
    spans = {k: (base + v["data_offsets"][0], base + v["data_offsets"][1]) for k, v in header.items() if k[:2] != "__"}
    return name, spans


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The median of each figure of each case over the rounds (ratios: the median of each round's own)."""
    medians: dict[str, dict[str, float]] = {}
    for case in rounds[0]:
        names = [k for k, v in rounds[0][case].items() if isinstance(v, float)]
        medians[case] = {k: statistics.median(r[case][k] for r in rounds) for k in names}
    return medians


def table(medians: dict[str, dict[str, float]], rounds: list[dict[str, Any]], names: list[str]) -> str:
    loads = sorted({r[case][key] for r in rounds for case in r for key in ("load_before", "load_after")})
    lines = ["| case | curl GB/s | curl CPU-s/GB | stfs GB/s | daemon CPU-s/GB | dd CPU-s/GB | ratios |"]
    lines.append("|---|---|---|---|---|---|---|")
    for case, m in medians.items():
        for name in names:
            label = case if len(names) == 1 else f"{case} ({name})"
            if case.startswith(("fetch", "splice")):
                held = m.get(f"{name}_pipe_held_kib")
                lines.append(
                    f"| {label}: {FETCH_THREADS} threads' {FETCH_BLOCK // MIB} MiB GETs, no FUSE | | | "
                    f"{m[f'{name}_fetch_gbs']:.2f} | {m[f'{name}_fetch_cpu']:.3f} (this process) | | "
                    + (
                        f"a full 1 MiB pipe held {held:.0f} KiB of the socket's (a reply: {REPLY >> 10}) |"
                        if held
                        else "|"
                    )
                )
                continue
            if case == "capped":
                lines.append(
                    f"| {label}, 50 MB/s a connection | {m['curl_gbs']:.3f} | | tensor {m[f'{name}_tensor_gbs']:.3f}, "
                    f"model {m[f'{name}_model_gbs']:.3f} | | | tensor {m[f'{name}_tensor_vs_curl']:.2f}x curl (>= "
                    f"{TARGETS['capped_tensor']}x), model {m[f'{name}_model_vs_curl']:.2f}x "
                    f"(>= {TARGETS['capped_model']}x) |"
                )
                continue
            lines.append(
                f"| {label} | {m['curl_gbs']:.2f} | {m['curl_cpu']:.3f} | {m[f'{name}_gbs']:.2f} "
                f"| {m[f'{name}_daemon_cpu']:.3f} | {m[f'{name}_dd_cpu']:.3f} | daemon CPU "
                f"{m[f'{name}_cpu_vs_curl']:.2f}x curl's (<= {TARGETS['cpu']}x), "
                f"rate {m[f'{name}_rate_vs_curl']:.2f}x (>= {TARGETS['rate']}x) |"
            )
            lines.append(
                f"| {label}: the daemon's threads that fetch / that answer reads (libfuse's) | | | | "
                f"{m[f'{name}_fetch_cpu']:.3f} / {m[f'{name}_daemon_cpu'] - m[f'{name}_fetch_cpu']:.3f} | | |"
            )
            lines.append(
                f"| {label}: the whole read path (client + nginx; stfs's dd too) | | {m['curl_path_cpu']:.3f} | | "
                f"{m[f'{name}_path_cpu']:.3f} | | {m[f'{name}_path_vs_curl']:.2f}x curl's; cores busy (of "
                f"{os.cpu_count()}, anyone's) during curl {m['curl_busy_cores']:.2f}, "
                f"stfs {m[f'{name}_busy_cores']:.2f} |"
            )
            if f"{name}_local_daemon_cpu" in m:
                lines.append(
                    f"| {label}: the file from disk | | | {m[f'{name}_local_gbs']:.2f} | "
                    f"{m[f'{name}_local_daemon_cpu']:.3f} | {m[f'{name}_local_dd_cpu']:.3f} | FUSE's page cache alone |"
                )
    lines.append(f"\nmedians of {len(rounds)} rounds; load (1, 5, 15 min) seen: {loads[0]} .. {loads[-1]}")
    if "fresh_memory_gbs" in medians.get("http", medians.get("https", {})):
        fresh = medians.get("http", medians.get("https", {}))["fresh_memory_gbs"]
        lines.append(f"new memory touched before each read (--cold: not): its first writes at {fresh:.2f} GB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/tmp/stfs-bench-cpu", help="where the model, nginx and mounts live")
    parser.add_argument("--size-mib", type=int, default=1024, help="the model's size (default 1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cases", default="http,https,capped", help="of http, https, capped, fetch-http, fetch-https, splice-http"
    )
    parser.add_argument("--fetch-child", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--fetch-tree", help=argparse.SUPPRESS)
    parser.add_argument("--fetch-spliced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--perf", help="perf record the daemon during the first HTTP read into this file")
    parser.add_argument("--cold", action="store_true", help="no memory touched before the reads (touch_memory)")
    parser.add_argument(
        "--checkout", action="append", default=[], metavar="NAME=PATH", help="stfs checkouts to compare"
    )
    parser.add_argument("--local", action="store_true", help="also dd of files/ of a mount of the file on disk")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args(argv)
    if args.fetch_child:
        fetch_child(args.fetch_child, args.size_mib * MIB, args.fetch_tree, args.fetch_spliced)
        return 0
    args.cases = [case for case in args.cases.split(",") if case]
    args.checkouts = [tuple(item.split("=", 1)) for item in args.checkout] or [("stfs", REPO)]
    args.checkouts = [(name, os.path.abspath(path)) for name, path in args.checkouts]
    for tool in ("nginx", "curl", "dd", "fusermount3"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            print(f"bench_cpu: needs {tool}", file=sys.stderr)
            return 1
    os.makedirs(args.data, exist_ok=True)
    tls = make_tls(Path(args.data) / "tls")
    nginx = Nginx(Path(args.data) / "nginx", tls=tls, executable=shutil.which("nginx") or "/usr/sbin/nginx")
    nginx.root.mkdir(parents=True, exist_ok=True)
    model, spans = the_model(nginx.root, args.size_mib * MIB)
    size = os.path.getsize(nginx.root / model)
    warm(nginx.root / model)  # nginx sends it from the page cache
    for name in list(os.environ):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            del os.environ[name]
    os.environ["SSL_CERT_FILE"] = str(tls.bundle)  # the daemon trusts the test CA this way
    nginx.start()
    rounds = []
    try:
        for number in range(args.rounds):
            log(f"round {number + 1} of {args.rounds}, load {load()}")
            rounds.append(one_round(number, nginx, str(tls.bundle), model, size, spans, args))
    finally:
        nginx.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "capped_rate": CAPPED_RATE}, indent=1))
    print(f"{size / MIB:.0f} MiB model {model}, nginx on 127.0.0.1 (capped: limit_rate {CAPPED_RATE} bytes/s)")
    print(table(summary(rounds), rounds, [name for name, _ in args.checkouts]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
