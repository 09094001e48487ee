"""A NodePublishVolume request read into a ``Volume`` and the secrets for its daemon, or refused with the gRPC status
SPEC §15 names. No I/O: the checks a request fails before anything is mounted."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..options import VIEWS, seconds, size_bytes
from . import csi_pb2

# volume_context: the volume's attributes (an inline volume's volumeAttributes, a PersistentVolume's
# spec.csi.volumeAttributes); the kubelet adds csi.storage.k8s.io/* (podInfoOnMount, ephemeral), ignored
ATTRIBUTES = ("source", "views", "layout", "cacheSize", "timeout")
KUBELET_PREFIX = "csi.storage.k8s.io/"
LAYOUTS = ("nested", "flat")
# nodePublishSecretRef's keys: the environment variables stfs reads, and a registry login
ENVIRONMENT_SECRETS = ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
LOGIN_SECRETS = ("username", "password")
SECRETS = ENVIRONMENT_SECRETS + LOGIN_SECRETS
AccessMode = csi_pb2.VolumeCapability.AccessMode
READERS = (AccessMode.SINGLE_NODE_READER_ONLY, AccessMode.MULTI_NODE_READER_ONLY)
WRITERS = (
    AccessMode.SINGLE_NODE_WRITER,
    AccessMode.MULTI_NODE_SINGLE_WRITER,
    AccessMode.MULTI_NODE_MULTI_WRITER,
    AccessMode.SINGLE_NODE_SINGLE_WRITER,
    AccessMode.SINGLE_NODE_MULTI_WRITER,
)
MOUNT_FLAGS = ("ro",)  # a PersistentVolume's mountOptions: a read-only mount is all there is


class Refused(Exception):
    """A call answered with ``code`` (not OK) and one line, ``message``, that names no secret."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class Volume:
    """What one NodePublishVolume asks for: ``volume_id`` at ``target``, SOURCE and ``stfs mount``'s settings."""

    volume_id: str
    target: str
    source: str
    views: tuple[str, ...] = ()
    layout: str = "nested"
    cache_size: str | None = None
    timeout: str | None = None

    def record(self) -> dict[str, object]:
        """What the state folder keeps of it: no secret (a URL's password and query left out)."""
        return {
            "volume_id": self.volume_id,
            "target": self.target,
            "source": shown(self.source),
            "views": list(self.views),
            "layout": self.layout,
            "cacheSize": self.cache_size,
            "timeout": self.timeout,
        }

    def mount_arguments(self) -> list[str]:
        """``stfs mount``'s options for it (before ``-- SOURCE TARGET``)."""
        arguments = ["--layout", self.layout]
        for view in self.views:
            arguments += ["--view", view]
        if self.cache_size is not None:
            arguments += ["--cache-size", self.cache_size]
        if self.timeout is not None:
            arguments += ["--timeout", self.timeout]
        return arguments


@dataclass(frozen=True, slots=True)
class Secrets:
    """The daemon's share of nodePublishSecretRef: environment variables, and a registry login (user, password)."""

    environment: dict[str, str]
    login: tuple[str, str] | None = None


def read_publish(request: csi_pb2.NodePublishVolumeRequest) -> tuple[Volume, Secrets]:
    """The volume and secrets of a NodePublishVolume request; ``Refused`` (INVALID_ARGUMENT) where it is not one
    stfs can publish."""
    if not request.volume_id:
        raise invalid("volume_id is missing")
    target = read_target(request.target_path)
    if not request.HasField("volume_capability"):
        raise invalid("volume_capability is missing")
    check_capability(request.volume_capability, request.readonly)
    context = dict(request.volume_context)
    unknown = sorted(key for key in context if key not in ATTRIBUTES and not key.startswith(KUBELET_PREFIX))
    if unknown:
        raise invalid(f"unknown volume attribute {unknown[0]!r} (stfs reads {', '.join(ATTRIBUTES)})")
    source = context.get("source", "")
    if not source:
        raise invalid("the volume attribute 'source' is missing (a path, http(s)://, s3://, hf:// or oci:// URL)")
    views = tuple(view.strip() for view in context.get("views", "").split(",") if view.strip())
    for view in views:
        if view not in VIEWS:
            raise invalid(f"views: unknown view {view!r} (one of {', '.join(VIEWS)})")
    layout = context.get("layout", "nested")
    if layout not in LAYOUTS:
        raise invalid(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    cache_size = _checked(context, "cacheSize", size_bytes)
    timeout = _checked(context, "timeout", seconds)
    volume = Volume(request.volume_id, target, source, tuple(dict.fromkeys(views)), layout, cache_size, timeout)
    return volume, read_secrets(dict(request.secrets), source)


def read_target(target: str) -> str:
    if not target:
        raise invalid("target_path is missing")
    if not os.path.isabs(target):
        raise invalid(f"target_path {target!r} is not an absolute path")
    return os.path.normpath(target)


def check_capability(capability: csi_pb2.VolumeCapability, readonly: bool) -> None:
    """Read-only file system volumes only: a block volume, or a writer's access mode not marked read-only, is
    refused (the kubelet sends an inline volume as SINGLE_NODE_WRITER, ``readonly`` from its ``readOnly``)."""
    if capability.HasField("block"):
        raise invalid("a block volume was asked for; stfs publishes a read-only file system (volumeMode Filesystem)")
    if not capability.HasField("mount"):
        raise invalid("volume_capability has no access type (mount)")
    flags = [flag for flag in capability.mount.mount_flags if flag not in MOUNT_FLAGS]
    if flags:
        raise invalid(f"mount flag {flags[0]!r} is not one stfs takes (only ro)")
    mode = capability.access_mode.mode
    if mode in WRITERS:
        if not readonly:
            name = AccessMode.Mode.Name(mode)
            raise invalid(f"access mode {name} without readOnly: stfs volumes are read-only (set readOnly: true)")
    elif mode not in READERS:
        raise invalid("volume_capability has no access mode")


def read_secrets(secrets: dict[str, str], source: str) -> Secrets:
    """The secrets nodePublishSecretRef named: each key one stfs knows (the key named if not, never a value)."""
    unknown = sorted(key for key in secrets if key not in SECRETS)
    if unknown:
        raise invalid(f"unknown secret key {unknown[0]!r} (stfs reads {', '.join(SECRETS)})")
    environment = {key: secrets[key] for key in ENVIRONMENT_SECRETS if key in secrets}
    given = [key for key in LOGIN_SECRETS if key in secrets]
    if not given:
        return Secrets(environment)
    if len(given) == 1:
        missing = next(key for key in LOGIN_SECRETS if key not in secrets)
        raise invalid(f"the secret has {given[0]!r} but not {missing!r}: a registry login needs both")
    if not source.lower().startswith(("oci://", "docker://")):
        raise invalid("the secret's username and password are a registry login: for oci:// sources only")
    return Secrets(environment, (secrets["username"], secrets["password"]))


def _checked(context: dict[str, str], key: str, read: Callable[[str | None], object]) -> str | None:
    """``context[key]`` as given, once ``read`` (an ``options`` reader) accepts it; None where it is not set."""
    value = context.get(key)
    if value is None:
        return None
    try:
        read(value)
    except ValueError as exc:
        raise invalid(f"{key}: {exc}") from None
    return value


def shown(source: str) -> str:
    """SOURCE as logs and the state folder show it: an HTTP(S) URL without its user, password and query (a
    presigned URL's signature)."""
    if not source.startswith(("http://", "https://")):
        return source
    parts = urllib.parse.urlsplit(source)
    if not (parts.username or parts.password or parts.query):
        return source
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", parts.fragment))
