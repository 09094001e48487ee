"""Mounting and unmounting: validate, build the tree, serve in the background, report readiness."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import errors
from .model import resolve, source_files
from .sources import ByteSource
from .tree import Tree
from .views import build_tree, with_chosen

log = logging.getLogger("stfs")

READY_TIMEOUT = 60.0
DAEMON_EXIT_WAIT = 15.0  # seconds `stfs unmount` waits for the daemon to end after the mount is gone
LIBFUSE_MAX_THREADS = 10  # libfuse's default size of its thread pool (helper.c)
DEFAULT_OPTIONS = {
    "ro": True,
    "kernel_cache": True,  # the tree never changes: re-reads and other processes' reads stay in the kernel
    "attr_timeout": 86400,
    "entry_timeout": 86400,
    "negative_timeout": 86400,
    "use_ino": True,
    "subtype": "stfs",
    # One thread: under the GIL, libfuse's pool only adds hand-offs (docs/benchmarks.md); --threads to change.
    "nothreads": True,
}


@dataclass
class MountPlan:
    """Everything decided before anything is mounted."""

    source: str
    mountpoint: str
    tree: Tree
    files: ByteSource
    options: dict[str, object] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def parse_options(text_options: list[str]) -> dict[str, object]:
    """``-o a,b=c`` values into mfusepy keyword options."""
    options: dict[str, object] = {}
    for text in text_options:
        for item in filter(None, text.split(",")):
            key, sep, value = item.partition("=")
            options[key] = value if sep else True
    return options


def plan_mount(
    source: ByteSource,
    key: str,
    mountpoint: str,
    layout: str = "nested",
    options: list[str] | None = None,
    threads: bool = False,
    views: list[str] | None = None,
) -> MountPlan:
    """Validate the models ``key`` names in ``source``, and MOUNTPOINT, and build the tree; raise ``StfsError``
    on any problem. ``threads`` serves with libfuse's thread pool instead of one thread; ``views`` names the
    views (``npy``, ``f32``, ``stats``, ``png``) added to every model."""
    mountpoint = os.path.abspath(mountpoint)
    check_mountpoint(mountpoint)
    # Millions of objects and no garbage cycles: the cyclic GC would walk them all again and again
    # (a 100,000-tensor mount took 2-3x longer with it on).
    collecting = gc.isenabled()
    gc.disable()
    try:
        models = resolve(key, source)
        files = source_files(key, source, models)
        tree = build_tree(models, layout, with_chosen(views or []), files=files, jump_windows=source.remote)
    finally:
        if collecting:
            gc.enable()
    # commas would split the -o list; keep the name readable in `mount` output
    merged = {**DEFAULT_OPTIONS, "fsname": key.replace(",", "_"), **parse_options(options or [])}
    if threads:
        merged.pop("nothreads", None)
        # libfuse 3.12-3.14 start with max_idle_threads at UINT_MAX and log "Ignoring invalid max threads value
        # 4294967295" at every threaded mount; as many idle threads as threads at all is the same (none ever exit)
        merged.setdefault("max_idle_threads", merged.get("max_threads", LIBFUSE_MAX_THREADS))
    if merged.get("allow_other"):
        merged["default_permissions"] = True  # with other users in, the kernel enforces the 0444/0555 modes
    return MountPlan(
        source=key,
        mountpoint=mountpoint,
        tree=tree,
        files=source,
        options=merged,
        warnings=[*(warning for model in models for warning in model.warnings), *source.warnings],
    )


def check_mountpoint(mountpoint: str, empty: bool = False) -> None:
    """Raise ``MountError`` unless ``mountpoint`` is a folder with nothing mounted on it; ``empty``: and it holds
    nothing, which a mount would hide (libfuse 3 and mount(8) allow it silently; ``stfs mount`` asks, unless
    ``--nonempty``)."""
    if is_dead_mount(mountpoint):
        raise errors.MountError(
            f"{mountpoint}: a mount whose daemon died is still there; run `stfs unmount {mountpoint}`"
        )
    if not os.path.exists(mountpoint):
        raise errors.MountError(f"{mountpoint}: mountpoint does not exist")
    if not os.path.isdir(mountpoint):
        raise errors.MountError(f"{mountpoint}: mountpoint is not a directory")
    if os.path.ismount(mountpoint):
        raise errors.MountError(f"{mountpoint}: something is already mounted there")
    if empty and _holds_anything(mountpoint):
        raise errors.MountError(
            f"{mountpoint}: mountpoint is not empty (the mount would hide what it holds); empty it, or add -o nonempty"
        )


def _holds_anything(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is not None
    except OSError:  # not for this user to list: libfuse (fusermount3) decides
        return False


def is_dead_mount(mountpoint: str) -> bool:
    """Whether a FUSE mount at ``mountpoint`` lost its daemon ("Transport endpoint is not connected")."""
    try:
        os.statvfs(mountpoint)  # stat() may be answered from the kernel's attribute cache; statfs never is
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def default_log_file(mountpoint: str) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/stfs-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, "stfs" + os.path.abspath(mountpoint).replace("/", "%") + ".log")


def run_foreground(plan: MountPlan, debug: bool = False) -> None:
    """Serve ``plan`` in this process until it is unmounted or sent SIGTERM/SIGINT."""
    gc.freeze()  # the tree lives as long as the mount: no collection need ever look at it again
    _serve(plan, lambda: None, debug=debug)


def _serve(plan: MountPlan, then: Callable[[], None], debug: bool = False) -> None:
    """Serve ``plan`` until unmounted; ``then`` runs once the mount answers, readahead tuned."""
    from ._libfuse import request_size, serve  # libfuse is loaded only by the commands that mount
    from .fs import StfsOperations

    options = dict(plan.options)
    # The largest read request whose reply can be spliced here; the kernel asks for no more than max_read.
    options.setdefault("max_read", request_size())
    readahead_kb = max(128, int(options["max_read"]) // 1024)  # type: ignore[call-overload]

    def ready() -> None:
        operations.readahead.tune(_mount_device(plan.mountpoint), readahead_kb)
        then()

    operations = StfsOperations(plan.tree, plan.files, on_ready=lambda: _after_init(plan.mountpoint, ready))
    serve(operations, plan.mountpoint, foreground=True, debug=debug, **options)


def run_background(make_plan: Callable[[], MountPlan], mountpoint: str, log_file: str) -> int:
    """Fork a daemon that plans (``make_plan()``: validation, the tree) and serves; return its PID once the
    mount is ready. A validation error comes back as ``StfsError`` (its one line), any other failure as
    ``MountError``; the planning's warnings are printed here, on stderr.

    Planning happens in the daemon, after the fork: a remote source's client (obstore) has threads that
    would not survive a fork, and a local source's descriptors are held by the process that serves.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()  # before any thread exists: the source's and libfuse's threads start in the child
    if pid == 0:
        os.close(read_end)
        _close_inherited(keep=write_end)
        _daemon_main(make_plan, log_file, write_end)
    os.close(write_end)
    ready = False
    try:
        for kind, message in _messages(read_end):
            if kind == "warning":
                print(f"stfs: warning: {message}", file=sys.stderr)
            elif kind == "ok":
                ready = True
                return pid
            elif kind == "error":
                raise errors.StfsError(message)
            else:
                raise errors.MountError(f"{os.path.abspath(mountpoint)}: mount failed: {message} (log: {log_file})")
    finally:
        os.close(read_end)
        if not ready:  # a failure, no answer, or Ctrl-C here: no daemon left to mount once nobody waits for it
            _stop_daemon(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    raise errors.MountError(f"{os.path.abspath(mountpoint)}: mount failed: no answer (log: {log_file})")


def _stop_daemon(pid: int, grace: float = 5.0) -> None:
    """SIGTERM the daemon ``pid`` (still planning: it ends; already mounted: it unmounts) and reap it within
    ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def _close_inherited(keep: int) -> None:
    """Close every descriptor the daemon inherited but stdin, stdout, stderr and ``keep``.

    What its starter handed down (the lock of ``flock LOCK stfs mount ...``, a pipe a script waits on) would
    otherwise stay held for the life of the mount; the daemon opens its sources itself, after this.
    """
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))


def _messages(read_end: int) -> Iterator[tuple[str, str]]:
    """``(kind, text)`` lines from the daemon until it says ``ok`` or fails; a silence of READY_TIMEOUT ends them."""
    poller = select.poll()  # not select(): with a thousand sources held open, descriptors pass FD_SETSIZE
    poller.register(read_end, select.POLLIN)
    deadline = time.monotonic() + READY_TIMEOUT
    pending = b""
    while time.monotonic() < deadline:
        if not poller.poll(100):
            continue
        chunk = os.read(read_end, 65536)
        if not chunk:
            if pending.strip():
                yield "failed", pending.decode("utf-8", "replace").strip()
            yield "failed", "the daemon exited before the mount was ready"
            return
        pending += chunk
        deadline = time.monotonic() + READY_TIMEOUT  # still planning (a big or remote model): wait on
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            kind, _, text = line.decode("utf-8", "surrogateescape").partition("\t")
            yield (
                (kind, text)
                if kind in ("ok", "warning", "error", "failed")
                else ("failed", line.decode("utf-8", "replace"))
            )
    yield "failed", "no answer"


def _daemon_main(make_plan: Callable[[], MountPlan], log_file: str, ready_fd: int) -> None:
    status = 1

    def tell(kind: str, text: str = "") -> None:
        with contextlib.suppress(BrokenPipeError):  # the starter has gone (killed): nobody to tell
            os.write(ready_fd, f"{kind}\t{text}\n".encode("utf-8", "surrogateescape"))

    try:
        os.setsid()
        try:
            plan = make_plan()
        except errors.StfsError as exc:
            tell("error", exc.message.replace("\n", " "))
            return
        except Exception as exc:  # a bug: one line on the terminal, the traceback in the log
            _log_traceback(log_file)
            lines = str(exc).strip().splitlines()
            tell("failed", f"{type(exc).__name__}: {lines[0][:300] if lines else ''}")
            return
        for warning in plan.warnings:
            tell("warning", warning)
        gc.freeze()  # the tree lives as long as the daemon: no collection need ever look at it again
        _redirect_output(log_file)
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", force=True
        )

        def report_ready() -> None:
            tell("ok")
            os.close(ready_fd)
            log.info("serving %s at %s", plan.source, plan.mountpoint)

        try:
            _serve(plan, report_ready)
        except errors.StfsError as exc:  # libfuse refused the mount (its words): one line, as a planning error
            log.error("%s", exc.message)
            with contextlib.suppress(OSError):
                tell("error", exc.message.replace("\n", " "))
            return
        status = 0
    except BaseException as exc:  # the parent must hear why, whatever happened
        log.exception("daemon failed")
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"{type(exc).__name__}: {exc}\n".encode())
    finally:
        logging.shutdown()
        os._exit(status)


def _log_traceback(log_file: str) -> None:
    """Append the exception being handled, with its traceback, to the daemon's log."""
    import traceback

    with (
        contextlib.suppress(OSError),
        open(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as stream,
    ):
        stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} stfs[{os.getpid()}] ERROR planning the mount failed\n")
        traceback.print_exc(file=stream)


def _redirect_output(log_file: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _after_init(mountpoint: str, then: Callable[[], None]) -> None:
    """Once the kernel has taken libfuse's INIT reply, call ``then`` (in a thread of its own): it tunes readahead.

    Called from the init callback, which runs before libfuse replies to INIT; the kernel then
    clamps the mount's readahead to what INIT negotiated (128 KiB), undoing anything written
    earlier. A statfs of the mountpoint blocks until INIT is done (and this daemon serves it); unlike
    a stat, it leaves no attributes in the kernel's cache (a stat of a dead mount must say ENOTCONN).
    """

    def run() -> None:
        try:
            os.statvfs(mountpoint)
        except OSError as exc:
            log.error("%s does not answer after INIT: %s", mountpoint, exc)
            return
        then()

    threading.Thread(target=run, name="stfs-ready", daemon=True).start()


def _mount_device(mountpoint: str) -> str | None:
    """The "major:minor" of the newest mount at ``mountpoint``, from /proc/self/mountinfo."""
    device = None
    try:
        with open("/proc/self/mountinfo") as stream:
            for line in stream:
                fields = line.split()
                if len(fields) > 4 and unescape_mountinfo(fields[4]) == mountpoint:
                    device = fields[2]
    except OSError:
        return None
    return device


def unescape_mountinfo(text: str) -> str:
    """A path as /proc/self/mountinfo spells it (space, tab, newline and backslash as ``\\ooo``), as it is."""
    return re.sub(r"\\([0-7]{3})", lambda code: chr(int(code[1], 8)), text)


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """Unmount MOUNTPOINT, including a mount whose daemon died; raise ``MountError`` with advice if busy."""
    mountpoint = os.path.abspath(mountpoint)
    if not os.path.ismount(mountpoint) and not is_dead_mount(mountpoint):
        raise errors.MountError(f"{mountpoint}: not mounted")
    pid = None if lazy else daemon_pid(mountpoint)
    command = [_fusermount(), "-u", *(["-z"] if lazy else []), mountpoint]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        if "busy" in detail.lower():
            raise errors.MountError(
                f"{mountpoint}: mount is busy (a process has a file or folder open there); close it, "
                f"or run `stfs unmount --lazy {mountpoint}` to detach it now and finish when it is released"
            )
        raise errors.MountError(f"{mountpoint}: unmount failed: {detail}")
    deadline = time.monotonic() + 10
    while os.path.ismount(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The daemon finishes what it was doing (the pieces it is writing to --cache-dir): a mount right after this
    # finds them
    deadline = time.monotonic() + DAEMON_EXIT_WAIT
    while pid is not None and _running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """Whether process ``pid`` is alive (a zombie, whose parent has not reaped it yet, has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stream:
            return stream.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _fusermount() -> str:
    for name in ("fusermount3", "fusermount"):
        found = shutil.which(name)
        if found:
            return found
    raise errors.MountError("neither fusermount3 nor fusermount is installed (Debian: apt-get install fuse3)")


@contextlib.contextmanager
def mounted(
    source: str,
    mountpoint: str,
    layout: str = "nested",
    options: list[str] | None = None,
    timeout: float = READY_TIMEOUT,
) -> Iterator[str]:
    """Mount SOURCE at MOUNTPOINT in a child process for the ``with`` block; always unmount after it."""
    command = [sys.executable, "-m", "stfs", "mount", source, mountpoint, "-f", "--layout", layout]
    for option in options or []:
        command += ["-o", option]
    # Output goes to a file, not a pipe: nobody reads a pipe while the block runs, and a daemon that logs
    # (an EIO per failed read) would fill it and block every thread on the logging lock.
    with tempfile.TemporaryFile(mode="w+") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout
            while not os.path.ismount(mountpoint):
                if process.poll() is not None:
                    output.seek(0)
                    raise errors.MountError(f"{mountpoint}: mount failed: {output.read().strip()}")
                if time.monotonic() > deadline:
                    raise errors.MountError(f"{mountpoint}: not mounted after {timeout} s")
                time.sleep(0.1)
            yield os.path.abspath(mountpoint)
        finally:
            if os.path.ismount(mountpoint) or is_dead_mount(mountpoint):
                with contextlib.suppress(errors.MountError):
                    unmount(mountpoint)
                if os.path.ismount(mountpoint):
                    with contextlib.suppress(errors.MountError):
                        unmount(mountpoint, lazy=True)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def daemon_pid(mountpoint: str) -> int | None:
    """The PID of the stfs daemon serving ``mountpoint`` (the root's ``user.stfs.pid``), or None."""
    try:
        return int(os.getxattr(mountpoint, "user.stfs.pid"))
    except (OSError, ValueError):
        return None
