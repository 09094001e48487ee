"""``stfs csi``: CSI v1's Identity and Node services (and ControllerGetCapabilities, empty) on a unix socket.

Each call is one short method; ``Refused`` becomes its gRPC status, anything unexpected INTERNAL with one line
(the traceback in the log). Calls of services or methods csi.proto here does not declare are answered
UNIMPLEMENTED by gRPC itself. Publish and unpublish of one target are serialised; a second call on a target
while one runs is ABORTED, as CSI asks (the kubelet retries).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf import wrappers_pb2

from .. import __version__
from . import DRIVER_NAME, csi_pb2, csi_pb2_grpc
from .mounts import DEAD, LIVE, NONE, at_target, clear, publish, remove_target
from .policy import Policy
from .state import State
from .volumes import Refused, Volume, read_publish, read_target, shown

log = logging.getLogger("stfs.csi")

WORKERS = 8  # calls served at once: the kubelet publishes one pod's volumes side by side
Reply = TypeVar("Reply")


def answering(method: Callable[..., Reply]) -> Callable[..., Reply]:
    """A servicer method whose ``Refused`` ends the call with its status, and whose bugs end it INTERNAL."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Reply:
        try:
            return method(self, request, context)
        except Refused as exc:
            log.info("%s: %s %s", method.__name__, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        raise AssertionError("context.abort returns only by raising")

    return call


class Identity(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def GetPluginCapabilities(
        self, request: Any, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        return csi_pb2.GetPluginCapabilitiesResponse()  # a node plugin alone: no controller service

    def Probe(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class Controller(csi_pb2_grpc.ControllerServicer):
    def ControllerGetCapabilities(
        self, request: Any, context: grpc.ServicerContext
    ) -> csi_pb2.ControllerGetCapabilitiesResponse:
        return csi_pb2.ControllerGetCapabilitiesResponse()  # csi-sanity's node tests ask; none


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, node_id: str, state: State, policy: Policy) -> None:
        self.node_id = node_id
        self.state = state
        self.policy = policy
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.NodeGetCapabilitiesResponse:
        return csi_pb2.NodeGetCapabilitiesResponse()  # no staging, stats or expansion: publish and unpublish only

    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)

    @answering
    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        volume, secrets = read_publish(request)
        self.policy.check_cache(volume.cache_size)
        self.policy.check(volume.source)  # refused before anything of it is read, fetched or mounted
        with self._only_call_on(volume.target):
            if self._already_published(volume):
                return csi_pb2.NodePublishVolumeResponse()
            made = not os.path.isdir(volume.target)
            os.makedirs(volume.target, mode=0o755, exist_ok=True)
            log.info("publish %s at %s: %s", volume.volume_id, volume.target, shown(volume.source))
            self.state.save(volume.record())
            try:
                home = self.state.fresh_home(volume.target)
                warnings = publish(volume, secrets, self.state.log_path(volume.target), home, self.policy)
            except BaseException:
                self.state.forget(volume.target, log=False)
                if made:  # as it was: the kubelet's retry, or its cleanup of the pod, finds no trace
                    with contextlib.suppress(OSError):
                        os.rmdir(volume.target)
                raise
            for warning in warnings:
                log.warning("%s: %s", volume.volume_id, warning)
            return csi_pb2.NodePublishVolumeResponse()

    @answering
    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        if not request.volume_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is missing")
        target = read_target(request.target_path)
        with self._only_call_on(target):
            state, _ = at_target(target)
            log.info("unpublish %s at %s (%s)", request.volume_id, target, state)
            if state != NONE:
                clear(target)
            remove_target(target)
            self.state.forget(target)
            return csi_pb2.NodeUnpublishVolumeResponse()

    def _already_published(self, volume: Volume) -> bool:
        """Whether ``volume`` is mounted at its target already (OK, nothing to do); ``Refused`` ALREADY_EXISTS if
        something else is. A dead mount (its daemon gone) is cleared, to be mounted again in place."""
        state, kind = at_target(volume.target)
        if state == LIVE:
            if self.state.load(volume.target) == volume.record():
                return True
            what = "another volume" if kind == "fuse.stfs" else f"a {kind} file system"
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"{volume.target}: {what} is mounted there")
        if state == DEAD:
            log.warning(
                "%s: its daemon is gone (transport endpoint is not connected); mounting it again", volume.target
            )
            clear(volume.target)
        return False

    @contextlib.contextmanager
    def _only_call_on(self, target: str) -> Iterator[None]:
        with self._lock:
            if target in self._busy:
                raise Refused(grpc.StatusCode.ABORTED, f"{target}: another call on it is in progress")
            self._busy.add(target)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(target)


def socket_path(endpoint: str) -> str:
    """The path of ``unix:///PATH`` (or ``unix:PATH``, or a bare absolute path)."""
    path = endpoint.removeprefix("unix://") if endpoint.startswith("unix://") else endpoint.removeprefix("unix:")
    if not os.path.isabs(path):
        from ..errors import StfsError

        raise StfsError(f"--endpoint {endpoint!r}: not unix:///ABSOLUTE/PATH")
    return path


def listen(path: str) -> None:
    """Make ``path`` free for the socket: its folder made, a socket file a previous plugin left removed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        from ..errors import StfsError

        raise StfsError(f"{path}: exists and is not a socket; not replacing it")
    os.unlink(path)


def serve(endpoint: str, node_id: str, state_dir: str, policy: Policy) -> None:
    """Serve until SIGTERM or SIGINT; the mounts (each its own daemon) stay."""
    state = State(state_dir)
    known = list(state.records())
    if known:
        log.info("%d volume(s) published before, in %s", len(known), state.folder)
    path = socket_path(endpoint)
    listen(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(Controller(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(node_id, state, policy), server)
    server.add_insecure_port(f"unix://{path}")
    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.start()
    log.info("%s %s serving on unix://%s as node %s", DRIVER_NAME, __version__, path, node_id)
    log.info(
        "sources allowed: %s; paths allowed: %s; --max-cache-size %s; %s",
        " ".join(policy.sources),
        " ".join(policy.paths) or "none",
        policy.max_cache_size,
        "volumes use the plugin's own credentials (--node-credentials)"
        if policy.node_credentials
        else "each volume has its own secret's credentials only",
    )
    while not stopping.wait(1.0):
        pass
    log.info("stopping; the mounts stay")
    server.stop(grace=5).wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
