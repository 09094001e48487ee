"""Mounts at a volume's target: ``stfs mount`` run as a child whose daemon outlives the plugin, its one-line refusal
turned into the gRPC status SPEC §15 names, ``stfs unmount``, and what the mount table holds at a target."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import grpc

from .. import errors
from ..daemon import is_dead_mount, unescape_mountinfo, unmount
from .volumes import Refused, Secrets, Volume

log = logging.getLogger("stfs.csi")

NONE, LIVE, DEAD = "none", "live", "dead"  # what is at a target
MOUNT_OPTIONS = "allow_other"  # the pod's processes are not root: every user reads (stfs adds default_permissions)

# stfs's one-line refusals, by what the kubelet should make of them: refused credentials first (a 401 and a 403
# read alike otherwise), then a server that does not answer (UNAVAILABLE: the kubelet retries), else the SOURCE
# itself is wrong (INVALID_ARGUMENT). The phrases are those of stfs/sources/failures.py, registry.py and urls.py;
# tests/test_csi.py meets each kind through a real server.
_DENIED = re.compile(r"\(HTTP 403\)|access denied \(denied\)")
_UNAUTHENTICATED = re.compile(
    r"\(HTTP 401\)|needs credentials|asks for a user and password|refuses the credentials|refuses access to user"
    r"|a token is needed|asks for authentication"
)
_UNAVAILABLE = re.compile(
    r"does not answer|connection refused|does not resolve|no answer from the server|connection was reset"
    r"|cannot reach|answered HTTP (?:5\d\d|429)\b"
)


def status_of(message: str) -> grpc.StatusCode:
    """The gRPC status for ``stfs mount``'s one-line refusal (exit 1)."""
    if _DENIED.search(message):
        return grpc.StatusCode.PERMISSION_DENIED
    if _UNAUTHENTICATED.search(message):
        return grpc.StatusCode.UNAUTHENTICATED
    if _UNAVAILABLE.search(message):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT


def at_target(target: str) -> tuple[str, str | None]:
    """What is mounted at ``target``: ``(NONE | LIVE | DEAD, its file system type)``; DEAD is a FUSE mount whose
    daemon is gone ("Transport endpoint is not connected")."""
    kind = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as stream:
        for line in stream:
            fields, _, rest = line.partition(" - ")
            if unescape_mountinfo(fields.split(" ")[4]) == target:
                kind = rest.split(" ", 1)[0]  # the last one listed is the one on top
    if kind is None:
        return NONE, None
    return (DEAD if is_dead_mount(target) else LIVE), kind


def publish(volume: Volume, secrets: Secrets, log_file: str) -> list[str]:
    """Mount ``volume`` at its target (which exists and has nothing mounted) with ``stfs mount``; return its
    warnings once the mount is ready, or raise ``Refused`` with stfs's one line. Secrets go to the child's
    environment, never its command line; a registry login to a private file removed once the mount is ready
    (the daemon reads it when it opens the source, before the mount answers)."""
    command = [sys.executable, "-m", "stfs", "mount", "-o", MOUNT_OPTIONS, "--log-file", log_file]
    command += [*volume.mount_arguments(), "--", volume.source, volume.target]
    with _login_file(volume.source, secrets.login) as auth_file:
        environment = {**os.environ, **secrets.environment}
        if auth_file is not None:
            environment["REGISTRY_AUTH_FILE"] = auth_file
        # stdin closed: nothing is asked; the daemon's own output goes to log_file once it serves
        result = subprocess.run(command, env=environment, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    lines = [line.removeprefix("stfs: ") for line in result.stderr.splitlines() if line.strip()]
    warnings = [line.removeprefix("warning: ") for line in lines if line.startswith("warning: ")]
    if result.returncode == 0:
        return warnings
    said = next((line for line in reversed(lines) if not line.startswith("warning: ")), f"exit {result.returncode}")
    if result.returncode == 1:
        if "mount failed" in said:  # the daemon crashed or libfuse refused: not the SOURCE's fault
            raise Refused(grpc.StatusCode.INTERNAL, said)
        raise Refused(status_of(said), said)
    if result.returncode == 2:  # a usage error: an attribute stfs mount does not take after all
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, said.rpartition(": error: ")[2] or said)
    raise Refused(grpc.StatusCode.INTERNAL, f"stfs mount failed ({said})")


@contextlib.contextmanager
def _login_file(source: str, login: tuple[str, str] | None) -> Iterator[str | None]:
    """A registry auth file (docker's ``config.json`` form) with ``login`` for SOURCE's host, in a folder of its own
    only root reads (0700, the file 0600), removed after the block."""
    if login is None:
        yield None
        return
    from ..sources.registry import parse_reference

    try:
        host = parse_reference(source).host
    except errors.StfsError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, exc.message) from None
    folder = tempfile.mkdtemp(prefix="stfs-csi-login-")
    try:
        path = os.path.join(folder, "auth.json")
        token = base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as stream:
            json.dump({"auths": {host: {"auth": token}}}, stream)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def clear(target: str) -> None:
    """Unmount whatever stfs mount is at ``target`` (a dead one too), lazily when it is busy."""
    try:
        unmount(target)
    except errors.MountError as exc:
        if at_target(target)[0] == NONE:
            return
        log.info("%s; detaching it lazily", exc.message)
        try:
            unmount(target, lazy=True)
        except errors.MountError as lazy:
            raise Refused(grpc.StatusCode.INTERNAL, lazy.message) from None


def remove_target(target: str) -> None:
    """Remove the (empty) target folder; gone already is fine."""
    try:
        os.rmdir(target)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        os.unlink(target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise Refused(grpc.StatusCode.INTERNAL, f"{target}: not empty after unmount; left in place") from None
        raise Refused(grpc.StatusCode.INTERNAL, f"{target}: cannot remove it: {exc.strerror}") from None
