"""Fixtures: FUSE availability, a ``mount`` that undoes every mount at teardown, and the real servers the
remote tests run against (nginx, a Hub-shaped tree on it, moto's S3, a fault proxy, an OCI registry with its token
issuer and a blob-redirecting proxy), all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stfs import errors  # first: import stfs names libfuse3 for mfusepy, which a test module may import next
from stfs.daemon import mounted, unescape_mountinfo, unmount
from tests.helpers import IN_CI, MountFn, need_fuse
from tests.registry import BlobRedirector, Registry, TokenIssuer, write_registry_auth_file
from tests.servers import (
    S3,
    S3_ENV,
    FakeHub,
    FaultProxy,
    MotoServer,
    Nginx,
    StdlibHttpServer,
    TlsFiles,
    find_tool,
    make_tls,
)


def stfs_mounts() -> set[str]:
    """Mount points of this namespace's stfs mounts (``/proc/self/mountinfo``: field 5; the type after `` - ``)."""
    found = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as stream:
        for line in stream:
            fields, _, rest = line.partition(" - ")
            if rest.split(" ", 1)[0] == "fuse.stfs":
                found.add(unescape_mountinfo(fields.split(" ")[4]))
    return found


@pytest.fixture(autouse=True)
def no_mount_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A mount a test made and left (a refusal that was not refused, a failure before its own unmount) is undone
    when the test ends. Only under this run's own temporary folder (another pytest run on the machine mounts too),
    and not one that was there before the test (a module's fixture)."""
    own = str(tmp_path_factory.getbasetemp()) + os.sep
    before = stfs_mounts()
    yield
    for mountpoint in stfs_mounts() - before:
        if mountpoint.startswith(own):
            with contextlib.suppress(errors.MountError):
                unmount(mountpoint, lazy=True)


@pytest.fixture
def require_fuse() -> None:
    """Mount tests skip without /dev/fuse locally, but fail in CI."""
    need_fuse()


@pytest.fixture
def mount(tmp_path_factory: pytest.TempPathFactory, require_fuse: None) -> Iterator[MountFn]:
    """``mount(source, layout=..., options=[...]) -> mountpoint``; every mount is undone at teardown."""
    with contextlib.ExitStack() as stack:

        def do_mount(source: str, layout: str = "nested", options: list[str] | None = None) -> str:
            mountpoint = str(tmp_path_factory.mktemp("mnt"))
            return stack.enter_context(mounted(source, mountpoint, layout=layout, options=options))

        yield do_mount


def _missing(what: str) -> None:
    """Server tests skip when a server is not installed locally, but fail in CI (.ci/run installs them)."""
    if IN_CI:
        pytest.fail(f"{what} is missing in CI")
    pytest.skip(f"{what} is not installed here (bash scripts/setup.sh)")


def _local_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy set in the environment must not carry requests meant for 127.0.0.1 anywhere else.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles | None:
    """A test CA and a certificate for 127.0.0.1 it signed; None without ``cryptography``."""
    try:
        return make_tls(tmp_path_factory.mktemp("tls"))
    except ImportError:
        return None


@pytest.fixture
def nginx(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles | None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Nginx]:
    """A fresh nginx for the test: files under ``nginx.root`` at ``nginx.url`` (and ``nginx.https_url``, with
    ``SSL_CERT_FILE`` set to a bundle that trusts it); ``nginx.log`` tells what went over the wire."""
    executable = find_tool("nginx")
    if executable is None:
        _missing("nginx (Debian package nginx-light)")
    server = Nginx(tmp_path_factory.mktemp("nginx"), tls=tls_files, executable=str(executable))
    try:
        server.start()
        _local_only(monkeypatch)
        if tls_files is not None:
            # SSL_CERT_FILE for OpenSSL, rustls-native-certs and Python; requests and curl read their own.
            for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
                monkeypatch.setenv(name, str(tls_files.bundle))
        yield server
    finally:
        server.stop()


@pytest.fixture
def http_server(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StdlibHttpServer]:
    """``python3 -m http.server`` serving ``http_server.root`` at ``http_server.url`` (it ignores Range); stopped by
    its PID at teardown."""
    server = StdlibHttpServer(tmp_path_factory.mktemp("http-server") / "root")
    try:
        server.start()
        _local_only(monkeypatch)
        yield server
    finally:
        server.stop()


@pytest.fixture
def hub(nginx: Nginx, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """A Hub at ``hub.endpoint`` (``HF_ENDPOINT`` set to it, ``HF_TOKEN`` unset, a private ``HF_HOME``);
    ``hub.publish_repo(org, repo, {path: bytes}, revision="main") -> commit``."""
    fake = FakeHub(nginx)
    home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads these once, at import: a client in this process must see the fake too.
    if "huggingface_hub" in sys.modules or importlib.util.find_spec("huggingface_hub") is not None:
        constants = importlib.import_module("huggingface_hub.constants")
        monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HOME", str(home))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    return fake


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the session (it takes a second to start); ``s3`` resets it for each test."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        _missing("moto[server] (pip install -e '.[test]')")
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> S3:
    """An empty S3 at ``s3.endpoint`` with ``AWS_ENDPOINT_URL`` and test credentials in the environment;
    ``s3.create_bucket(name, versioned=False)``, ``s3.put_object(bucket, key, data) -> PutResult``."""
    moto_server.reset()
    _local_only(monkeypatch)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    # No shared config or credentials files from the machine: the environment above is the whole story.
    empty = tmp_path_factory.mktemp("aws")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
    return S3(moto_server.endpoint)


@pytest.fixture
def fault_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], FaultProxy]]:
    """``fault_proxy(upstream_url, tls=None) -> FaultProxy``, started (serving HTTPS given ``tls``); every proxy made
    is stopped at teardown."""
    _local_only(monkeypatch)
    proxies: list[FaultProxy] = []

    def make(upstream: str, tls: TlsFiles | None = None) -> FaultProxy:
        proxy = FaultProxy(upstream, tls).start()
        proxies.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for proxy in proxies:
            proxy.stop()


# --- OCI registries (tests/registry.py) -------------------------------------------------------------------

REGISTRY_USER, REGISTRY_PASSWORD = "stfs-puller", "Reg1stry-Pa55-never-shown"
PUBLIC_REPO = "stfs/public-model"  # anonymous clients get pull on it from the token issuer
TOKEN_LIFETIME = 300


def _registry_executable() -> str:
    executable = find_tool("docker-registry")
    if executable is None:
        _missing("docker-registry (Debian package docker-registry)")
    assert executable is not None
    return executable


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """One plain registry for the session at ``registry.url`` (``registry.host`` for ``oci://``); each test takes
    its own repositories with ``registry.repo("hint")``; ``tests.registry.push(registry, repo, tag, artifact)``."""
    server = Registry(tmp_path_factory.mktemp("registry"), executable=_registry_executable())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass
class TokenRegistry:
    """A registry that wants Docker tokens, its issuer, the user it knows and its public repository."""

    registry: Registry
    issuer: TokenIssuer
    user: str
    password: str
    public_repo: str

    @property
    def host(self) -> str:
        return self.registry.host

    @property
    def url(self) -> str:
        return self.registry.url

    @property
    def credentials(self) -> tuple[str, str]:
        return self.user, self.password

    def repo(self, hint: str = "model") -> str:
        return self.registry.repo(hint)


@pytest.fixture(scope="session")
def _token_registry_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, TokenIssuer]]:
    executable = _registry_executable()
    workdir = tmp_path_factory.mktemp("token-registry")
    issuer = TokenIssuer(workdir / "issuer", {REGISTRY_USER: REGISTRY_PASSWORD}, [PUBLIC_REPO], TOKEN_LIFETIME)
    server = Registry(workdir / "registry", auth=issuer, executable=executable)
    try:
        issuer.start()
        server.start()
        yield server, issuer
    finally:
        server.stop()
        issuer.stop()


@pytest.fixture
def token_registry(
    _token_registry_servers: tuple[Registry, TokenIssuer], monkeypatch: pytest.MonkeyPatch
) -> Iterator[TokenRegistry]:
    """The session's token-auth registry with its issuer's record cleared: ``user``/``password`` may pull and push
    anywhere, anonymous may pull ``public_repo`` only. A test may set ``issuer.expires_in`` (e.g. 3 s) or add to
    ``issuer.public``: both are restored after it."""
    server, issuer = _token_registry_servers
    _local_only(monkeypatch)
    issuer.clear()
    public = set(issuer.public)
    try:
        yield TokenRegistry(server, issuer, REGISTRY_USER, REGISTRY_PASSWORD, PUBLIC_REPO)
    finally:
        issuer.expires_in = TOKEN_LIFETIME
        issuer.public = public
        issuer.clear()


def _redirector(registry: Registry) -> Iterator[BlobRedirector]:
    proxy = BlobRedirector(registry)
    try:
        proxy.start()
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def blob_redirector(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[BlobRedirector]:
    """A proxy at ``blob_redirector.url`` in front of ``registry`` that answers blob reads with a 307 to its CDN at
    ``http://localhost:PORT`` (``cdn_requests()`` tells what reached it); push through ``registry`` or the proxy."""
    _local_only(monkeypatch)
    yield from _redirector(registry)


@pytest.fixture
def token_blob_redirector(token_registry: TokenRegistry) -> Iterator[BlobRedirector]:
    """The same in front of the token-auth registry: a blob read without a valid token gets the registry's 401."""
    yield from _redirector(token_registry.registry)


@pytest.fixture
def registry_auth_file(tmp_path: Path) -> Callable[[str, str, str], Path]:
    """``registry_auth_file(host, user, password) -> path`` of a docker ``config.json`` with that login (tests set
    ``REGISTRY_AUTH_FILE`` to it)."""
    folder = tmp_path / "registry-auth"

    def write(host: str, user: str, password: str) -> Path:
        return write_registry_auth_file(folder, host, user, password)

    return write
