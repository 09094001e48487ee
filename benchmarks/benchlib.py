"""What the benchmarks share: which checkout's stfs they mount and how, the other FUSE servers they compare it
with, how they time a read, warm or drop the page cache, and the models they write.

Every benchmark imports this module and none imports another, but for bench.py's ``remote`` section
(bench_remote.py) and bench_remote_ab.py, which runs that section's model: so there is one ``STFS_REPO``
whichever script runs as ``__main__``. Each runs as ``python3 benchmarks/NAME.py`` from any folder; it puts
this checkout first on ``sys.path`` and imports ``benchmarks.benchlib``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
PAGE = 4096

MOUNT_ARGS: list[str] = []  # --mount-arg: more `stfs mount` arguments for every mount
STFS_REPO = [REPO]  # the checkout whose stfs the mounts run (--stfs; the ab section switches it run by run)

Mounted = TypeVar("Mounted", bound="Mount | ServerMount")
T = TypeVar("T")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def environment() -> dict[str, str]:
    env = dict(os.environ, LC_ALL="C")
    env["PYTHONPATH"] = STFS_REPO[0] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def bytecode_environment(pycache: str) -> dict[str, str]:
    """``environment()`` with bytecode cached (in ``pycache``) as an installed package has it: torch's is, in
    site-packages, and where the environment says PYTHONDONTWRITEBYTECODE a fresh process compiles stfs again."""
    env = environment()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def stfs_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "stfs", *args]


# ---------------------------------------------------------------------------------------------- measuring


def dd_seconds(path: str, skip: int = 0, count: int | None = None) -> float:
    """Seconds dd reports for copying the range to /dev/null with 1 MiB blocks."""
    command = ["dd", f"if={path}", "of=/dev/null", "bs=1M"]
    if skip or count is not None:
        command.append("iflag=skip_bytes,count_bytes")
        command.append(f"skip={skip}")
        if count is not None:
            command.append(f"count={count}")
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), check=True)
    match = re.search(r"copied, ([0-9.e+-]+) s", result.stderr)
    if not match:
        raise RuntimeError(f"cannot parse dd output: {result.stderr!r}")
    return float(match.group(1))


def cat_seconds(*paths: str | os.PathLike[str]) -> float:
    """Wall seconds of ``cat PATHS > /dev/null``."""
    started = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def cpu_seconds(pid: int, stat: str = "stat") -> float:
    """User + system CPU time of process ``pid`` so far (``stat``: ``task/TID/stat``, one thread's)."""
    with open(f"/proc/{pid}/{stat}") as stream:
        fields = stream.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fields(pid: int, name: str) -> dict[str, int]:
    """``kB`` fields of /proc/PID/status or smaps_rollup, in bytes."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/{name}") as stream:
        for line in stream:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return values


def resident(pid: int, shared: bool = False) -> int:
    """The daemon's own memory: RssAnon of process ``pid``, in bytes; with ``shared`` RssShmem too (a memfd
    cache's pages)."""
    fields = proc_fields(pid, "status")
    return fields["RssAnon"] + (fields.get("RssShmem", 0) if shared else 0)


def peak_rss_while(pid: int, work: Callable[[], T], shared: bool = False) -> tuple[T, int]:
    """``work()``'s result and the highest ``resident(pid, shared)`` meanwhile (sampled every 10 ms)."""
    peak = [resident(pid, shared)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            with contextlib.suppress(OSError, KeyError):
                peak[0] = max(peak[0], resident(pid, shared))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = work()
    finally:
        done.set()
        sampler.join()
    with contextlib.suppress(OSError, KeyError):  # a process ``work`` waited for is gone
        peak[0] = max(peak[0], resident(pid, shared))
    return result, peak[0]


class CountedReads:
    """``read(offset, size)`` by ``os.pread`` of an open file, counting the requests and bytes asked for."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.requests = 0
        self.bytes = 0

    def __call__(self, offset: int, size: int) -> bytes:
        self.requests += 1
        self.bytes += size
        return os.pread(self.fd, size, offset)


# ---------------------------------------------------------------------------------------------- the page cache


def warm(*paths: str | os.PathLike[str]) -> None:
    """Read each file once, so that its pages are in the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as stream:
            while stream.read(8 * MIB):
                pass


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- mounts


def daemon_ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stream:
        return stream.read().rpartition(")")[2].split()[0] == "Z"
    return True


class Mount:
    """A background ``stfs mount SOURCE MOUNTPOINT ARGS [-o OPTION ...]`` of the checkout ``STFS_REPO`` names, as
    a context manager that unmounts it and waits for the daemon to end: ``seconds`` it took to return, the
    daemon's ``pid``. With ``stats`` the daemon counts its requests (STFS_STATS) and ``stats()`` asks for them."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        mountpoint: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        options: Sequence[str] = (),
        stats: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.source = str(source)
        self.mountpoint = str(mountpoint)
        self.stats_path = self.mountpoint.rstrip("/") + ".stats.json"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stats_path)
        os.makedirs(self.mountpoint, exist_ok=True)
        command = stfs_command("mount", self.source, self.mountpoint, *args, *MOUNT_ARGS)
        for option in options:
            command += ["-o", option]
        env = dict(env if env is not None else environment())
        if stats:
            env["STFS_STATS"] = self.stats_path
        started = time.perf_counter()
        # cwd: `python -m stfs` puts the current folder first on sys.path, ahead of PYTHONPATH
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=STFS_REPO[0])
        self.seconds = time.perf_counter() - started
        if result.returncode != 0 or not os.path.ismount(self.mountpoint):
            raise RuntimeError(f"stfs mount failed: {result.stderr.strip()}")
        self.pid = self._daemon_pid()
        self._dumps = 0
        self.no_stats = not stats

    def __enter__(self: Mounted) -> Mounted:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unmount()

    def _daemon_pid(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(os.getxattr(self.mountpoint, "user.stfs.pid"))
        for entry in os.listdir("/proc"):  # an stfs from before user.stfs.pid (bench runs older versions too)
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as stream:
                    args = stream.read().split(b"\0")
            except OSError:
                continue
            if b"stfs" in args and b"mount" in args and self.mountpoint.encode() in args:
                return int(entry)
        raise RuntimeError(f"no daemon found for {self.mountpoint}")

    def environ(self) -> dict[str, str]:
        """The daemon's environment."""
        with open(f"/proc/{self.pid}/environ", "rb") as stream:
            pairs = [item.split(b"=", 1) for item in stream.read().split(b"\0") if b"=" in item]
        return {key.decode(): value.decode() for key, value in pairs}

    def stats(self) -> dict[str, Any] | None:
        """The daemon's counters now (SIGUSR1, then wait for the new dump); None from an stfs without them."""
        if self.no_stats:
            return None
        if not self._takes_sigusr1():  # SIGUSR1 would kill a daemon without STFS_STATS (an older stfs)
            log("no STFS_STATS counters from this stfs: daemon request figures left out")
            self.no_stats = True
            return None
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + (10 if self._dumps else 3)
        while time.monotonic() < deadline:
            try:
                with open(self.stats_path) as stream:
                    data = json.load(stream)
                if data["dumps"] > self._dumps:
                    self._dumps = data["dumps"]
                    return data
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        if self._dumps:
            raise RuntimeError("the daemon stopped dumping its counters")
        log("no STFS_STATS counters from this stfs: daemon request figures left out")
        self.no_stats = True
        return None

    def _takes_sigusr1(self) -> bool:
        """Whether some thread of the daemon blocks or catches SIGUSR1 (/proc/PID/task/*/status masks)."""
        bit = 1 << (signal.SIGUSR1 - 1)
        for task in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{task}/status") as stream:
                for line in stream:
                    if line.startswith(("SigBlk:", "SigCgt:")) and int(line.split()[1], 16) & bit:
                        return True
        return False

    def unmount(self) -> None:
        subprocess.run(["fusermount3", "-u", self.mountpoint], check=True)
        deadline = time.monotonic() + 20
        while not daemon_ended(self.pid) and time.monotonic() < deadline:
            time.sleep(0.02)


class ServerMount:
    """A FUSE server run in the foreground as a child of this process (the C reference, squashfuse_ll, rclone),
    as a context manager: started and waited for until its mount answers; unmounted and waited for on the way
    out (terminated if it does not end)."""

    def __init__(
        self,
        command: list[str],
        mountpoint: str,
        name: str,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 10,
        log_path: str | None = None,
    ) -> None:
        self.mountpoint = mountpoint
        os.makedirs(mountpoint, exist_ok=True)
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                said = ""
                if log_path is not None and os.path.exists(log_path):
                    with open(log_path) as stream:
                        said = ": " + stream.read()[-500:]
                raise RuntimeError(f"{name} did not mount{said}")
            time.sleep(0.02)

    def __enter__(self: Mounted) -> Mounted:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unmount()

    def unmount(self) -> None:
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", self.mountpoint], check=False)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait(timeout=10)


class CReference(ServerMount):
    """benchmarks/cref.c, a minimal C libfuse3 server of one file (``/big``), mounted like stfs for comparison.

    With ``source`` "list:FILE" it serves the tree ``tree_listing`` wrote instead (for ``find``), with the mount
    options stfs mounts with (stfs/daemon.py DEFAULT_OPTIONS: one thread, use_ino, the same timeouts); ``plus``
    (CREF_PLUS) says which entries its readdir hands over with their attributes: folders (as stfs), all, none.
    """

    def __init__(
        self,
        binary: str,
        source: str,
        offset: int,
        size: int,
        mountpoint: str,
        single: bool = False,
        plus: str = "folders",
    ) -> None:
        options = "ro,kernel_cache,attr_timeout=86400,entry_timeout=86400,fsname=cref"
        if source.startswith("list:"):
            options += ",negative_timeout=86400"  # and use_ino, set by cref.c in its init
            single = True
        command = [binary, source, str(offset), str(size), mountpoint, "-f", *(["-s"] if single else []), "-o", options]
        super().__init__(command, mountpoint, "the C reference server", env=dict(os.environ, CREF_PLUS=plus))
        os.statvfs(mountpoint)  # INIT done: the readahead setting now sticks
        with open("/proc/self/mountinfo") as stream:
            device = [line.split()[2] for line in stream if line.split()[4] == mountpoint][-1]
        with contextlib.suppress(OSError), open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as stream:
            stream.write("1024")  # 1 MiB requests, libfuse's most
        self.file = os.path.join(mountpoint, "big")


def c_reference(data: str, skip: bool = False) -> str | None:
    """The C reference server, built in ``data`` if it is not yet; None with ``skip`` or without gcc or libfuse3
    (the figures are then left out)."""
    if skip or shutil.which("gcc") is None:
        return None
    binary = os.path.join(data, "cref")
    source = os.path.join(REPO, "benchmarks", "cref.c")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(source):
        result = subprocess.run(
            ["gcc", "-O2", "-o", binary, source, "-l:libfuse3.so.3"], capture_output=True, text=True
        )
        if result.returncode != 0:
            log(f"cannot build the C reference: {result.stderr.strip()[:200]}")
            return None
    return binary


class SquashFuse(ServerMount):
    """squashfuse_ll (the low-level squashfuse, C) serving ``image`` in the foreground, its default options."""

    def __init__(self, image: str, mountpoint: str) -> None:
        super().__init__(["squashfuse_ll", "-f", image, mountpoint], mountpoint, "squashfuse_ll")


LISTING = """
import sys
from stfs.model import resolve, source_files
from stfs.nodes import DirNode
from stfs.sources import open_source
from stfs.views import build_tree
source, key = open_source(sys.argv[1], mounting=True)
models = resolve(key, source)
tree = build_tree(models, files=source_files(key, source, models))
with open(sys.argv[2], "w") as stream:
    for path, node in tree.walk():
        folder = type(node) is DirNode
        stream.write(f"{'d' if folder else 'f'}\\t{0 if folder else node.size}\\t{path}\\n")
"""


def tree_listing(path: str) -> str:
    """The tree an stfs mount of ``path`` shows, one line per entry (``d|f\\tSIZE\\tPATH``, folders before what
    they hold): written by this checkout's stfs from its own tree, for benchmarks/cref.c and mksquashfs."""
    listing = path + ".tree"
    if not os.path.exists(listing) or os.path.getmtime(listing) < os.path.getmtime(path):
        subprocess.run([sys.executable, "-c", LISTING, path, listing + ".new"], check=True, env=environment())
        os.replace(listing + ".new", listing)
    return listing


def squashfs_image(listing: str) -> str | None:
    """A squashfs image of the listed tree (sparse files of the listed sizes), for squashfuse_ll; None without
    mksquashfs."""
    if shutil.which("mksquashfs") is None:
        return None
    image = listing + ".squashfs"
    if os.path.exists(image) and os.path.getmtime(image) >= os.path.getmtime(listing):
        return image
    staging = listing + ".d"
    shutil.rmtree(staging, ignore_errors=True)
    with open(listing) as stream:
        for line in stream:
            kind, size, path = line.rstrip("\n").split("\t", 2)
            target = staging + path
            if kind == "d":
                os.makedirs(target, exist_ok=True)
            else:
                with open(target, "wb") as out:
                    out.truncate(int(size))
    subprocess.run(
        ["mksquashfs", staging, image + ".new", "-noappend", "-quiet", "-no-progress"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    os.replace(image + ".new", image)
    shutil.rmtree(staging)
    return image


def find_seconds(mountpoint: str) -> float:
    """Wall time of `find MNT -type f | wc -l` (the figure of the issue)."""
    started = time.perf_counter()
    subprocess.run(f"find {mountpoint} -type f | wc -l", shell=True, check=True, capture_output=True)
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------- models


def write_model(path: str, tensors: list[tuple[str, str, list[int], int]], fill: Callable[[Any, int], None]) -> int:
    """Write a safetensors file by hand; ``tensors`` are (name, dtype, shape, nbytes); return the header length."""
    header: dict[str, Any] = {}
    position = 0
    for name, dtype, shape, size in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    temporary = path + ".tmp"
    with open(temporary, "wb") as stream:
        stream.write(struct.pack("<Q", len(body)))
        stream.write(body)
        fill(stream, position)
    os.replace(temporary, path)
    return len(body)


def random_fill(seed: int) -> Callable[[Any, int], None]:
    """A ``write_model`` fill of random bytes, quickly: a 16 MiB chunk, rotated so no page repeats."""

    def fill(stream: Any, total: int) -> None:
        chunk = random.Random(seed).randbytes(16 * MIB)
        written = 0
        while written < total:
            piece = chunk[: min(len(chunk), total - written)]
            stream.write(piece)
            written += len(piece)
            chunk = chunk[7:] + chunk[:7]  # not the same page twice

    return fill


def bf16_fill(seed: int, scale: float = 1.0) -> Callable[[Any, int], None]:
    """A ``write_model`` fill of normal values times ``scale`` as BF16 (float32's upper halves): what weights look
    like, and no NaN or infinity."""
    import numpy as np

    def fill(stream: Any, total: int) -> None:
        rng = np.random.default_rng(seed)
        for start in range(0, total, 32 * MIB):
            values = rng.standard_normal(min(32 * MIB, total - start) // 2, dtype=np.float32) * np.float32(scale)
            stream.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())

    return fill


MANY_PARTS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.down_proj.bias",
]


def many_names(count: int) -> list[str]:
    return [f"model.layers.{i // len(MANY_PARTS)}.{MANY_PARTS[i % len(MANY_PARTS)]}" for i in range(count)]


def many_model(folder: str, count: int) -> str:
    """A model of ``count`` small tensors named like a transformer's (nested folders), written once."""
    path = os.path.join(folder, f"many-{count}.safetensors")
    if os.path.exists(path):
        return path
    log(f"writing {path}")
    tensors = [(name, "F32", [4], 16) for name in many_names(count)]

    def fill(stream: Any, total: int) -> None:
        stream.write(bytes(total))

    write_model(path, tensors, fill)
    return path


def _token(rng: Any, i: int) -> str:
    # Byte-level BPE tokens as Qwen2's vocabulary spells them: mostly short ASCII pieces, some with Ġ and Ċ.
    length = int(rng.integers(1, 12))
    letters = "".join(chr(int(c)) for c in rng.integers(97, 123, size=length))
    return ("Ġ" if i % 3 == 0 else "") + letters + ("Ċ" if i % 97 == 0 else "") + str(i % 10)


def write_vocabulary_gguf(path: str, vocab: int) -> None:
    """With GGUFWriter, a GGUF holding a ``vocab``-token vocabulary as Qwen2's GGUFs carry it (tokens, scores,
    token_type, merges), some model keys and eight small tensors."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "qwen2")
    writer.add_name("bench")
    writer.add_context_length(32768)
    writer.add_embedding_length(896)
    writer.add_block_count(24)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen2.rope.freq_base", 1000000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    tokens = [_token(rng, i) for i in range(vocab)]
    writer.add_token_list(tokens)
    writer.add_token_scores([float(-i) for i in range(vocab)])
    writer.add_token_types([int(t) for t in rng.integers(1, 4, size=vocab)])
    writer.add_token_merges([f"{tokens[i]} {tokens[i + 1]}" for i in range(0, vocab - 1, 1)])
    writer.add_eos_token_id(151643)
    for layer in range(4):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(896, dtype=np.float32))
        writer.add_tensor(
            f"blk.{layer}.attn_q.weight",
            np.zeros((896, 896 // 32 * 34), dtype=np.uint8),
            raw_dtype=GGMLQuantizationType.Q8_0,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def checkpoint_shapes(size_mib: int) -> dict[str, tuple[int, ...]]:
    """A 24-layer decoder's state_dict (8 tensors a layer, embeddings, a norm, the head): 195 F32 tensors, the
    hidden size a multiple of 64 and the vocabulary chosen so that they add up to ``size_mib`` MiB within 1%."""
    layers, target = 24, size_mib * MIB // 4

    def per_layer(hidden: int) -> int:
        return 4 * hidden * hidden + 3 * hidden * 4 * hidden + hidden

    hidden = 64
    while layers * per_layer(hidden + 64) + 2 * 1024 * (hidden + 64) < target:
        hidden += 64
    vocab = (target - layers * per_layer(hidden) - hidden) // (2 * hidden)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for proj in ("q", "k", "v", "o"):
            out[f"{prefix}.self_attn.{proj}_proj.weight"] = (hidden, hidden)
        out[f"{prefix}.mlp.gate_proj.weight"] = (4 * hidden, hidden)
        out[f"{prefix}.mlp.up_proj.weight"] = (4 * hidden, hidden)
        out[f"{prefix}.mlp.down_proj.weight"] = (hidden, 4 * hidden)
        out[f"{prefix}.input_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def write_checkpoint(path: str, size_mib: int, legacy: bool = False) -> None:
    """``torch.save`` of ``checkpoint_shapes(size_mib)``'s zeros at ``path`` unless it exists (``legacy``: the
    layout before PyTorch 1.6, ``_use_new_zipfile_serialization=False``)."""
    import torch

    if os.path.exists(path):
        return
    state = {name: torch.zeros(shape) for name, shape in checkpoint_shapes(size_mib).items()}
    partial = os.path.join(os.path.dirname(path), ".partial")
    os.makedirs(partial, exist_ok=True)
    # Saved as its own name in a folder of its own: the archive's top folder is the file's stem.
    torch.save(state, os.path.join(partial, os.path.basename(path)), _use_new_zipfile_serialization=not legacy)
    os.replace(os.path.join(partial, os.path.basename(path)), path)


# What people run today to list a checkpoint's tensors: a fresh ``python3 -c TORCH_LIST PATH``.
TORCH_LIST = """
import sys, torch
state = torch.load(sys.argv[1], mmap=True, weights_only=True)
for name, tensor in state.items():
    print(name, tensor.dtype, list(tensor.shape))
"""
