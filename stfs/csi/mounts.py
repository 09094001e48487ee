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
from ..sources.base import DEFAULT_CACHE_SIZE
from . import environment
from .policy import Policy
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


def publish(volume: Volume, secrets: Secrets, log_file: str, home: str, policy: Policy) -> list[str]:
    """Mount ``volume`` at its target (which exists and has nothing mounted) with ``stfs mount``; return its
    warnings once the mount is ready, or raise ``Refused`` with stfs's one line. The child runs in ``environment``'s
    environment for the volume (``home``: its own empty folder, also its working folder, so that nothing there
    shadows the stfs installed); secrets go to its environment, never its command line; a registry login to a
    private file removed once the mount is ready (the daemon reads it when it opens the source, before the mount
    answers)."""
    # -P (3.11+) and an empty working folder: `-m stfs` finds the stfs this plugin runs, whatever the plugin's
    # working folder holds
    command = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "stfs", "mount"]
    command += ["-o", MOUNT_OPTIONS, "--log-file", log_file, *volume.mount_arguments()]
    if volume.cache_size is None and policy.cache_cap < DEFAULT_CACHE_SIZE:
        command += ["--cache-size", policy.max_cache_size]
    command += ["--", volume.source, volume.target]
    with _login_file(volume.source, secrets.login) as auth_file:
        given = {**secrets.environment, **({"REGISTRY_AUTH_FILE": auth_file} if auth_file is not None else {})}
        variables = environment.for_volume(os.environ, given, home, policy.node_credentials, policy.paths)
        # stdin closed: nothing is asked; the daemon's own output goes to log_file once it serves
        result = subprocess.run(
            command, env=variables, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
    lines = [line.removeprefix("stfs: ") for line in result.stderr.splitlines() if line.strip()]
    warnings = [told(line.removeprefix("warning: "), auth_file) for line in lines if line.startswith("warning: ")]
    if result.returncode == 0:
        return warnings
    said = next((line for line in reversed(lines) if not line.startswith("warning: ")), f"exit {result.returncode}")
    said = told(said, auth_file, anonymous=not policy.node_credentials)
    if result.returncode == 1:
        if "mount failed" in said:  # the daemon crashed or libfuse refused: not the SOURCE's fault
            raise Refused(grpc.StatusCode.INTERNAL, said)
        raise Refused(status_of(said), said)
    if result.returncode == 2:  # a usage error: an attribute stfs mount does not take after all
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, said.rpartition(": error: ")[2] or said)
    raise Refused(grpc.StatusCode.INTERNAL, f"stfs mount failed ({said})")


# What a refusal may not pass on to the pod creator (SPEC §15a): bytes of what was read (a file that is no model
# is named with its first bytes, and a header length those bytes spell), the files a volume without a secret found
# no login in (the volume's own empty home), the temporary auth file a volume's login was in (deleted by now)
_FIRST_BYTES = re.compile(r"[:,]? *\(?its first bytes are b(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\)?")
_BYTES = re.compile(r"\bb(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_LENGTH = re.compile(r"header length \d+ ")
_NONE_FOUND = re.compile(r"none found for it in .*\(docker login, podman login or oras login write them\)")


def told(message: str, auth_file: str | None, anonymous: bool = True) -> str:
    """``stfs mount``'s line as a publish's message: the rule that refused, never bytes of what it read."""
    if _FIRST_BYTES.search(message):  # not of the format at all: the length its first 8 bytes spell says nothing
        message = _LENGTH.sub("header length ", _FIRST_BYTES.sub("", message))
    message = _BYTES.sub("(bytes not shown)", message)
    if auth_file is not None:
        message = message.replace(auth_file, "the volume's secret")
    if anonymous:
        message = _NONE_FOUND.sub("the volume's secret has no username and password for it", message)
    return message


@contextlib.contextmanager
def _login_file(source: str, login: tuple[str, str] | None) -> Iterator[str | None]:
    """A registry auth file (docker's ``config.json`` form) with ``login`` for SOURCE's host, in a folder of its own
    only root reads (0700, the file 0600), removed after the block."""
    if login is None:
        yield None
        return
    from ..sources.registry import parse_reference

    try:
        host = parse_reference("oci://" + source.partition("://")[2]).host  # docker:// is oci:// too
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
