"""Real servers for the remote tests, all on 127.0.0.1: nginx (plain files, a Hub-shaped tree and its CDN),
moto's S3 server, and a small fault-injecting reverse proxy.

Each class starts its server in ``start()`` and stops it in ``stop()``; every wait has a deadline. The
fixtures in ``tests/conftest.py`` own them, so a test only fills folders, buckets and repositories.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import http.client
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

LOCALHOST = "127.0.0.1"
# nginx serves ``/private/`` only to this user (HTTP basic auth): the remote tests' URL with a password.
BASIC_USER, BASIC_PASSWORD = "stfs-user", "Pa55-w0rd-never-shown"
# nginx serves ``/signed/`` only to requests whose query holds this signature (a presigned URL's), until
# ``Nginx.expire_signatures()``: then it answers 403, as an object store does once a presigned URL has expired.
SIGNATURE = "5tf5TestSignatureNeverShown0123456789abcdef"
SIGNED_QUERY = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIASTFSTEST%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
    f"&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature={SIGNATURE}"
)
START_TIMEOUT = 15.0
CAPPED_RATE = 50_000_000  # bytes/s a connection under nginx's /capped/
STOP_TIMEOUT = 5.0


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after; starts retry if another took it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different ports nothing listens on now: each held until all are found (one at a time, the kernel
    may hand out the same port twice, and nginx then serves two of its servers on one)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for probe in probes:
            probe.bind((LOCALHOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def find_tool(name: str) -> str | None:
    """The tool's path, or None when it is not installed (sbin is not on every PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")


def wait_until(ready: Callable[[], bool], timeout: float, what: str, step: float = 0.02) -> None:
    """Poll ``ready()`` until it is true; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout} s")
        time.sleep(step)


def http_get(
    url: str, headers: dict[str, str] | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """One plain GET on its own connection: (status, headers with lower-case names, body)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or LOCALHOST, parts.port, timeout=timeout)
    try:
        connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def _probe(process: subprocess.Popen | None, name: str, url: str) -> tuple[int, bytes] | None:
    """A server's answer to a GET of ``url``: (status, body), None while it does not listen yet."""
    if process is None or process.poll() is not None:
        raise RuntimeError(f"{name} exited")
    try:
        status, _, body = http_get(url, timeout=1.0)
    except OSError:
        return None
    return status, body


def replace_file(path: Path, data: bytes) -> None:
    """Replace a served file by another object, as a writer that renames a new version over it would.

    nginx's ETag is ``"mtime-size"`` with mtime in whole seconds, so the new file's mtime is moved at least a
    second past the old one: same-size content written within the same second still gets a new ETag.
    """
    old_mtime = path.stat().st_mtime if path.exists() else 0.0
    temporary = path.with_name(f".{path.name}.replacing")
    temporary.write_bytes(data)
    mtime = max(time.time(), old_mtime + 2)
    os.utime(temporary, (mtime, mtime))
    os.replace(temporary, path)


def _stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a server started with ``start_new_session=True``: ``sig``, and SIGKILL to its process group if it
    is still there after ``STOP_TIMEOUT`` (nginx's workers would outlive a master killed alone)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        # Not reaped yet, so the group id (the pid we started) is still ours.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT)


# --- TLS --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A test CA, a server certificate it signed for 127.0.0.1 and localhost, and a CA bundle for clients."""

    ca: Path
    cert: Path
    key: Path
    bundle: Path  # the test CA plus the system's CAs: what SSL_CERT_FILE points at


def make_tls(folder: Path) -> TlsFiles:
    """Generate the CA and server certificate with ``cryptography`` (moto depends on it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stfs test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, LOCALHOST)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.IPv4Address(LOCALHOST)), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    files = TlsFiles(folder / "ca.pem", folder / "cert.pem", folder / "key.pem", folder / "bundle.pem")
    files.ca.write_bytes(ca_cert.public_bytes(pem))
    files.cert.write_bytes(cert.public_bytes(pem))
    files.key.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    system = b""
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and os.path.isfile(candidate):
            system = Path(candidate).read_bytes()
            break
    files.bundle.write_bytes(files.ca.read_bytes() + b"\n" + system)
    return files


# --- nginx's access log -----------------------------------------------------------------------------------

# One JSON object per request. $body_bytes_sent is the body alone, $bytes_sent adds the status line and headers.
LOG_FORMAT = (
    "log_format stfs escape=json '{"
    + ",".join(
        f'"{name}":"${variable}"'
        for name, variable in (
            ("time", "msec"),
            ("scheme", "scheme"),
            ("method", "request_method"),
            ("uri", "request_uri"),
            ("status", "status"),
            ("body_bytes", "body_bytes_sent"),
            ("bytes", "bytes_sent"),
            ("range", "http_range"),
            ("if_range", "http_if_range"),
            ("if_match", "http_if_match"),
            ("content_range", "sent_http_content_range"),
            ("authorization", "http_authorization"),
            ("connection", "connection"),
            ("connection_requests", "connection_requests"),
        )
    )
    + "}';"
)


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One request as nginx logged it: what was asked and how many bytes went back."""

    method: str
    uri: str  # path and query as the client sent them
    status: int
    body_bytes: int  # response body bytes sent ($body_bytes_sent)
    bytes: int  # everything sent, headers included ($bytes_sent)
    range: str  # the request's Range header, "" when none
    if_range: str
    if_match: str
    content_range: str  # the response's Content-Range, "" when none
    authorization: str  # the request's Authorization header: tests assert where a token did (not) go
    scheme: str
    connection: int  # nginx's connection serial number: equal numbers mean one reused connection
    connection_requests: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """What went over the wire: requests, and response body bytes."""

    requests: int
    bytes: int


class AccessLog:
    """An nginx access log written in the ``stfs`` JSON format."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self, at_least: int = 0, timeout: float = 5.0) -> list[LogEntry]:
        """Every request logged so far (since the last ``clear``).

        nginx writes a line once a response is sent, which can be a moment after the client has read it:
        pass ``at_least`` to wait (up to ``timeout`` s) for the requests a test knows it made.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._read()
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.01)

    def transfer(self, at_least: int = 0) -> Transfer:
        found = self.entries(at_least)
        return Transfer(len(found), sum(entry.body_bytes for entry in found))

    def clear(self) -> None:
        """Forget what was logged. nginx appends (O_APPEND), so it goes on writing at the new end."""
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.path, 0)

    def _read(self) -> list[LogEntry]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        # A line being written has no newline yet; it is read next time.
        return [_log_entry(json.loads(line)) for line in text.split("\n")[:-1] if line]


def _log_entry(raw: dict[str, str]) -> LogEntry:
    def number(name: str) -> int:
        value = raw.get(name, "")
        return int(value) if value.isdigit() else 0

    return LogEntry(
        method=raw["method"],
        uri=raw["uri"],
        status=number("status"),
        body_bytes=number("body_bytes"),
        bytes=number("bytes"),
        range=raw.get("range", ""),
        if_range=raw.get("if_range", ""),
        if_match=raw.get("if_match", ""),
        content_range=raw.get("content_range", ""),
        authorization=raw.get("authorization", ""),
        scheme=raw.get("scheme", ""),
        connection=number("connection"),
        connection_requests=number("connection_requests"),
    )


# --- nginx ------------------------------------------------------------------------------------------------


def _nginx_token(token: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", token):
        raise ValueError("a test token is letters, digits, '_', '.' and '-'")
    return token


def _nginx_string(value: str) -> str:
    """A value quoted for nginx's config, refusing what would need escaping (test paths are plain)."""
    if any(ch in value for ch in "'\\$;{}\n\r\t ") or len(value) > 400:
        raise ValueError(f"{value!r}: not a path this test server can map")
    return f"'{value}'"


@dataclass(slots=True)
class _HubObject:
    commit: str
    target: str  # the CDN path the resolve URL redirects to
    etag: str  # quoted, as the Hub sends X-Linked-Etag
    size: int


class Nginx:
    """One nginx process, its config, logs, pid file and temp paths all in ``workdir`` (no /etc, no /var).

    Three HTTP servers on free 127.0.0.1 ports (plus HTTPS on a fourth when ``tls`` is given):

    - ``url`` / ``https_url``: the files under ``root``, plainly, access log ``log``;
    - ``hub_url``: a Hub-shaped endpoint (``FakeHub`` fills it), access log ``hub_log``;
    - ``cdn_url``: where the Hub's ``/resolve/`` redirects, access log ``cdn_log``.

    ``gzip off`` and ``etag on`` everywhere, so a ranged GET gets a 206 with a ``"mtime-size"`` ETag.
    A change to the Hub's redirect table rewrites the config and reloads it (master process, SIGHUP).
    """

    def __init__(self, workdir: Path, tls: TlsFiles | None = None, executable: str = "nginx") -> None:
        self.workdir = workdir
        self.tls = tls
        self.executable = executable
        self.root = workdir / "files"  # root/private/ needs BASIC_USER and BASIC_PASSWORD
        self.hub_root = workdir / "hub"  # hub_root/api/models/ORG/REPO/...: the JSON answers
        self.cdn_root = workdir / "cdn"  # cdn_root/ORG/REPO/COMMIT/PATH: the bytes
        self.log = AccessLog(workdir / "files.log")
        self.hub_log = AccessLog(workdir / "hub.log")
        self.cdn_log = AccessLog(workdir / "cdn.log")
        self.hub_objects: dict[str, _HubObject] = {}  # resolve path -> what it redirects to
        self.hub_repos: set[str] = set()  # "ORG/REPO" of every repository published: others are not found
        self.hub_guards: dict[str, tuple[str, str]] = {}  # "ORG/REPO" -> (token it needs, "private" or "gated")
        self.redirect_base = ""  # where /resolve/ redirects: cdn_url unless a test puts a proxy in between
        self.port = self.https_port = self.hub_port = self.cdn_port = 0
        self._generation = 0
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def https_url(self) -> str | None:
        return f"https://{LOCALHOST}:{self.https_port}" if self.tls else None

    @property
    def hub_url(self) -> str:
        return f"http://{LOCALHOST}:{self.hub_port}"

    @property
    def cdn_url(self) -> str:
        return f"http://{LOCALHOST}:{self.cdn_port}"

    def put(self, relpath: str, data: bytes) -> str:
        """Write a file under ``root``; its URL."""
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return f"{self.url}/{relpath}"

    def replace(self, relpath: str, data: bytes) -> None:
        """Serve other bytes (and a new ETag) at ``relpath`` from now on: an object replaced mid-mount."""
        replace_file(self.root / relpath, data)

    def start(self) -> None:
        for folder in (self.root, self.hub_root, self.cdn_root, self.workdir / "temp"):
            folder.mkdir(parents=True, exist_ok=True)
        (self.workdir / "htpasswd").write_text(f"{BASIC_USER}:{{PLAIN}}{BASIC_PASSWORD}\n")
        for attempt in range(3):
            self.port, self.https_port, self.hub_port, self.cdn_port = free_ports(4)
            self.redirect_base = self.cdn_url
            self._write_config()
            self._process = subprocess.Popen(
                [self.executable, "-p", str(self.workdir), "-c", str(self._config), "-e", str(self._error_log)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                wait_until(self._serving, START_TIMEOUT, "nginx")
                return
            except (TimeoutError, RuntimeError):
                errors = self._errors()
                self.stop()
                # Another process may have taken a port between free_port() and nginx's bind: try new ones.
                if "Address already in use" not in errors or attempt == 2:
                    raise RuntimeError(f"nginx did not start: {errors}") from None

    @property
    def pid(self) -> int | None:
        """The master process's PID while it runs (its workers are its children)."""
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        if self._process is not None:
            _stop_process(self._process)  # SIGTERM: fast shutdown of master and workers
            self._process = None

    def expire_signatures(self, expired: bool = True) -> None:
        """From now on ``/signed/`` answers 403 to every request (presigned URLs expired), or serves again."""
        flag = self.workdir / "signatures-expired"
        if expired:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def set_redirect_base(self, base: str) -> None:
        """Make ``/resolve/`` redirect to ``base`` (e.g. a fault proxy in front of ``cdn_url``)."""
        self.redirect_base = base.rstrip("/")
        self.reload()

    def reload(self) -> None:
        """Rewrite the config and have the running nginx take it; return once only new workers serve."""
        with self._lock:
            assert self._process is not None, "nginx is not running"
            self._generation += 1
            self._write_config()
            check = subprocess.run(
                [self.executable, "-t", "-q", "-p", str(self.workdir), "-c", str(self._config), "-e", "/dev/null"],
                capture_output=True,
                text=True,
                timeout=STOP_TIMEOUT,
            )
            if check.returncode != 0:
                raise RuntimeError(f"nginx config rejected: {check.stderr.strip()}")
            old_workers = self._workers()
            self._process.send_signal(signal.SIGHUP)
            # The master starts new workers, then tells the old ones to finish: once they are gone, every new
            # connection sees the new config.
            wait_until(lambda: not (old_workers & self._workers()) and self._serving(), START_TIMEOUT, "nginx reload")

    @property
    def _config(self) -> Path:
        return self.workdir / "nginx.conf"

    @property
    def _error_log(self) -> Path:
        return self.workdir / "error.log"

    def _errors(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return self._error_log.read_text().strip()
        return ""

    def _serving(self) -> bool:
        answer = _probe(self._process, "nginx", f"{self.hub_url}/.stfs-generation")
        return answer == (200, str(self._generation).encode())

    def _workers(self) -> set[int]:
        assert self._process is not None
        children = set()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(entry.path, "stat").read_text()
                    # Field 4 (parent pid) follows the ")" that closes the command name.
                    if int(stat.rsplit(")", 1)[1].split()[1]) == self._process.pid:
                        children.add(int(entry.name))
        return children

    def _guard_locations(self) -> str:
        """Locations for private and gated repositories: their API and ``/resolve/`` answer only to their token."""
        blocks = []
        for repo, (token, kind) in sorted(self.hub_guards.items()):
            code = "GatedRepo" if kind == "gated" else "RepoNotFound"
            wrong = (
                f'            if ($http_authorization != "Bearer {_nginx_token(token)}") {{\n'
                f"                add_header X-Error-Code {code} always;\n"
                f'                return 401 \'{{"error": "a {kind} repository"}}\';\n'
                "            }\n"
            )
            escaped = re.escape(repo)
            blocks.append(
                f"        location ~ ^/api/models/{escaped}(/|$) {{\n{wrong}"
                "            default_type application/json;\n"
                "            try_files $uri/$hub_listing.json @api_missing;\n"
                "        }\n"
                f"        location ~ ^/{escaped}/resolve/ {{\n{wrong}"
                "            if ($hub_target = '') {\n"
                "                add_header X-Error-Code EntryNotFound always;\n"
                "                return 404;\n"
                "            }\n"
                "            add_header X-Repo-Commit $hub_commit always;\n"
                "            add_header X-Linked-Etag $hub_etag always;\n"
                "            add_header X-Linked-Size $hub_size always;\n"
                "            add_header ETag $hub_etag always;\n"
                f"            return 302 {self.redirect_base}$hub_target;\n"
                "        }"
            )
        return "\n".join(blocks)

    def _write_config(self) -> None:
        work = self.workdir
        temp = work / "temp"
        maps = []
        for name, key_of, value_of in (
            ("hub_target", "resolve", lambda o: o.target),
            ("hub_commit", "resolve", lambda o: o.commit),
            ("hub_etag", "resolve", lambda o: o.etag),
            ("hub_size", "resolve", lambda o: str(o.size)),
            ("cdn_commit", "cdn", lambda o: o.commit),
            ("cdn_etag", "cdn", lambda o: o.etag),
            ("cdn_size", "cdn", lambda o: str(o.size)),
        ):
            lines = [f"    map $uri ${name} {{", "        default '';"]
            seen = set()
            for resolve_path, obj in sorted(self.hub_objects.items()):
                key = resolve_path if key_of == "resolve" else obj.target
                if key not in seen:
                    seen.add(key)
                    lines.append(f"        {_nginx_string(key)} {_nginx_string(value_of(obj))};")
            lines.append("    }")
            maps.append("\n".join(lines))
        known = [f"        ~^/api/models/{re.escape(repo)}(/|$) 1;" for repo in sorted(self.hub_repos)]
        maps.append("\n".join(["    map $uri $hub_known_repo {", "        default 0;", *known, "    }"]))
        tls_listen = ""
        if self.tls:
            tls_listen = (
                f"        listen {LOCALHOST}:{self.https_port} ssl;\n"
                f"        ssl_certificate {self.tls.cert};\n"
                f"        ssl_certificate_key {self.tls.key};\n"
            )
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers read pytest's 0700 temp dirs
        self._config.write_text(
            f"""{user}daemon off;
master_process on;
worker_processes 2;
pid {work}/nginx.pid;
lock_file {work}/nginx.lock;
error_log {self._error_log} warn;
# A reload (a new commit, a new redirect) waits for the old workers: a client holding a connection open without a
# request (a pool's spare one) would keep one for client_header_timeout (60 s). As a real server's reload
# would, it drops such connections after a second; clients retry on a new one.
worker_shutdown_timeout 1s;
events {{ worker_connections 1024; }}
http {{
    {LOG_FORMAT}
    access_log off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    default_type application/octet-stream;
    types {{ application/json json; text/plain txt; text/html html; }}  # html: a listing for rclone (bench)
    sendfile on;
    tcp_nopush on;
    gzip off;
    etag on;
    server_tokens off;
    keepalive_timeout 75s;
    keepalive_requests 100000;
    map_hash_bucket_size 512;
    map_hash_max_size 65536;
    map $arg_recursive $hub_listing {{ ~*^(true|1)$ recursive; default index; }}
{chr(10).join(maps)}

    server {{
        listen {LOCALHOST}:{self.port};
{tls_listen}        root {self.root};
        access_log {self.log.path} stfs;
        location /private/ {{
            auth_basic "stfs";
            auth_basic_user_file {work}/htpasswd;
        }}
        location /capped/ {{  # a link capped per connection, as object stores and CDNs are (bench_cpu.py)
            alias {self.root}/;
            limit_rate {CAPPED_RATE};
        }}
        location /signed/ {{
            if (-f {work}/signatures-expired) {{ return 403; }}
            if ($args !~ "(^|&)X-Amz-Signature={SIGNATURE}(&|$)") {{ return 403; }}
        }}
    }}

    server {{
        listen {LOCALHOST}:{self.hub_port};
        root {self.hub_root};
        access_log {self.hub_log.path} stfs;
        location = /.stfs-generation {{ access_log off; return 200 "{self._generation}"; }}
        # huggingface_hub 2.x asks for this once a day when it thinks an AI agent runs it; not a request to count.
        location = /api/agent-harnesses {{ access_log off; return 404; }}
        location /api/ {{
            default_type application/json;
            try_files $uri/$hub_listing.json @api_missing;
        }}
        # As the Hub answers: a revision it does not have is 404 RevisionNotFound; a repository it does not have
        # (or will not show without a token) is 401 RepoNotFound.
        location @api_missing {{
            default_type application/json;
            if ($hub_known_repo) {{
                add_header X-Error-Code RevisionNotFound always;
                return 404 '{{"error": "Invalid rev id"}}';
            }}
            add_header X-Error-Code RepoNotFound always;
            return 401 '{{"error": "Repository not found"}}';
        }}
{self._guard_locations()}
        location / {{
            if ($hub_target = '') {{
                add_header X-Error-Code EntryNotFound always;
                return 404;
            }}
            add_header X-Repo-Commit $hub_commit always;
            add_header X-Linked-Etag $hub_etag always;
            add_header X-Linked-Size $hub_size always;
            add_header ETag $hub_etag always;
            return 302 {self.redirect_base}$hub_target;
        }}
    }}

    server {{
        listen {LOCALHOST}:{self.cdn_port};
        root {self.cdn_root};
        access_log {self.cdn_log.path} stfs;
        add_header X-Repo-Commit $cdn_commit;
        add_header X-Linked-Etag $cdn_etag;
        add_header X-Linked-Size $cdn_size;
    }}
}}
"""
        )


# --- the Hub ----------------------------------------------------------------------------------------------


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(path: str, data: bytes) -> bool:
    # The Hub's default .gitattributes sends weights to LFS; big files go there anyway.
    return path.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt")) or len(data) >= 10 * 1024 * 1024


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.writing")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


class FakeHub:
    """A Hugging Face Hub at ``endpoint`` (nginx's hub server), with what ``huggingface_hub`` asks of it:

    - ``GET /api/models/ORG/REPO[/revision/REV]``: model info with ``sha`` and ``siblings``;
    - ``GET /api/models/ORG/REPO/tree/REV[/FOLDER][?recursive=true]``: the file listing (one page);
    - ``GET|HEAD /ORG/REPO/resolve/REV/PATH``: 302 to the CDN (another port) with ``X-Repo-Commit``,
      ``X-Linked-Etag`` (sha256 for LFS files, the git blob sha otherwise), ``X-Linked-Size`` and ``ETag``;
      404 with ``X-Error-Code: EntryNotFound`` for a path that is not there.

    REV is a branch, a tag, a pull request's ``refs/pr/N`` (the Hub's clients send it as ``refs%2Fpr%2FN``), or a
    commit: its 40 hex digits, or a prefix of 7 or more. ``publish_repo`` makes a commit and moves the branch (or
    the pull request's ref) to it; earlier commits stay resolvable by their sha. ``tag`` names a commit.
    ``protect`` makes a repository private or gated: it answers only to its token (401 ``RepoNotFound`` or
    ``GatedRepo`` otherwise). A repository never published is 401 ``RepoNotFound``, a revision it lacks 404
    ``RevisionNotFound``, as on the Hub.
    """

    def __init__(self, nginx: Nginx) -> None:
        self.nginx = nginx
        self.branches: dict[tuple[str, str], dict[str, str]] = {}  # (org, repo) -> branch -> commit
        self.commits: dict[str, list[dict[str, Any]]] = {}  # commit -> its files, as the tree API lists them

    @property
    def endpoint(self) -> str:
        return self.nginx.hub_url

    @property
    def log(self) -> AccessLog:
        """Requests to the API and to ``/resolve/``."""
        return self.nginx.hub_log

    @property
    def cdn_log(self) -> AccessLog:
        """Requests that followed the redirect: where the bytes went."""
        return self.nginx.cdn_log

    def resolve_url(self, org: str, repo: str, path: str, revision: str = "main") -> str:
        return f"{self.endpoint}/{org}/{repo}/resolve/{revision}/{path}"

    def publish_repo(self, org: str, repo: str, files: dict[str, bytes], revision: str = "main") -> str:
        """Commit ``files`` (path in the repo -> bytes) as the whole tree of ``revision``; the commit's sha."""
        parent = self.branches.get((org, repo), {}).get(revision, "")
        digest = hashlib.sha1(f"{org}/{repo}\0{parent}\0{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{_git_blob_sha(files[path])}\0".encode())
        commit = digest.hexdigest()
        entries: list[dict[str, Any]] = []
        for path, data in sorted(files.items()):
            target = f"/{org}/{repo}/{commit}/{path}"
            cdn_file = self.nginx.cdn_root / target.lstrip("/")
            cdn_file.parent.mkdir(parents=True, exist_ok=True)
            cdn_file.write_bytes(data)
            blob = _git_blob_sha(data)
            entry: dict[str, Any] = {"type": "file", "oid": blob, "size": len(data), "path": path}
            etag = blob
            if _is_lfs(path, data):
                sha256 = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": 134}
                etag = sha256
            entries.append(entry)
            obj = _HubObject(commit=commit, target=target, etag=f'"{etag}"', size=len(data))
            for name in (revision, commit):
                self.nginx.hub_objects[f"/{org}/{repo}/resolve/{name}/{path}"] = obj
        # A branch shows only its newest tree: drop the old commit's files from the branch's resolve paths.
        prefix = f"/{org}/{repo}/resolve/{revision}/"
        for key in [k for k, obj in self.nginx.hub_objects.items() if k.startswith(prefix) and obj.commit != commit]:
            del self.nginx.hub_objects[key]
        self._write_api(org, repo, revision, commit, entries)
        self.branches.setdefault((org, repo), {})[revision] = commit
        self.commits[commit] = entries
        self.nginx.hub_repos.add(f"{org}/{repo}")
        self.nginx.reload()
        return commit

    def tag(self, org: str, repo: str, name: str, commit: str) -> None:
        """Name ``commit`` (published before) ``name`` as well: a tag."""
        entries = self.commits[commit]
        for key, obj in list(self.nginx.hub_objects.items()):
            prefix = f"/{org}/{repo}/resolve/{commit}/"
            if key.startswith(prefix):
                self.nginx.hub_objects[f"/{org}/{repo}/resolve/{name}/{key[len(prefix) :]}"] = obj
        self._write_api(org, repo, name, commit, entries, short=False)
        self.nginx.reload()

    def protect(self, org: str, repo: str, token: str, kind: str = "private") -> None:
        """Serve ``ORG/REPO`` (API and ``/resolve/``) only to ``Authorization: Bearer TOKEN``; ``kind`` is
        ``private`` or ``gated`` (what the Hub's ``X-Error-Code`` says to a request without it)."""
        self.nginx.hub_guards[f"{org}/{repo}"] = (token, kind)
        self.nginx.reload()

    def _write_api(
        self, org: str, repo: str, revision: str, commit: str, files: list[dict[str, Any]], short: bool = True
    ) -> None:
        base = self.nginx.hub_root / "api" / "models" / org / repo
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        info = {
            "_id": commit[:24],
            "id": f"{org}/{repo}",
            "modelId": f"{org}/{repo}",
            "author": org,
            "sha": commit,
            "lastModified": now,
            "createdAt": now,
            "private": False,
            "disabled": False,
            "gated": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [
                {"rfilename": f["path"], "size": f["size"], "blobId": f["oid"]}
                | ({"lfs": {"sha256": f["lfs"]["oid"], "size": f["size"], "pointerSize": 134}} if "lfs" in f else {})
                for f in files
            ],
        }
        folders = sorted({str(Path(f["path"]).parent) for f in files} | {"."})
        folders = sorted({str(p) for folder in folders for p in [Path(folder), *Path(folder).parents]})
        for prefix in range(7, 40) if short else ():  # a commit's short spellings: the API only
            _write_json(base / "revision" / commit[:prefix] / "index.json", info)
        for name in (revision, commit):
            _write_json(base / "revision" / name / "index.json", info)
            if name == "main":
                _write_json(base / "index.json", info)
            for folder in folders:
                _write_json(base / "tree" / name / folder / "index.json", _listing(files, folder, recursive=False))
                _write_json(base / "tree" / name / folder / "recursive.json", _listing(files, folder, recursive=True))


def _listing(files: list[dict[str, Any]], folder: str, recursive: bool) -> list[dict[str, Any]]:
    """The tree API's answer for ``folder`` ("." for the root): its files and folders, or all below it."""
    inside = [f for f in files if folder == "." or f["path"].startswith(folder + "/")]
    depth = 0 if folder == "." else folder.count("/") + 1
    answer: list[dict[str, Any]] = []
    folders: set[str] = set()
    for entry in inside:
        parts = entry["path"].split("/")
        for level in range(depth + 1, len(parts)):
            if recursive or level == depth + 1:
                folders.add("/".join(parts[:level]))
        if recursive or len(parts) == depth + 1:
            answer.append(entry)
    for name in sorted(folders):
        answer.append({"type": "directory", "oid": hashlib.sha1(name.encode()).hexdigest(), "size": 0, "path": name})
    return answer


# --- moto (S3) --------------------------------------------------------------------------------------------


class StdlibHttpServer:
    """``python3 -m http.server --bind 127.0.0.1`` on a free port, serving ``root``: the server everyone starts
    first, which ignores Range (every GET is answered 200 with the whole file) and sends no ETag. ``gets()``: the
    GETs it logged so far, as (path, status)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._output = root.parent / f"{root.name}-http-server.log"

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".probe").write_bytes(b"ok")
        for attempt in range(3):
            self.port = free_port()
            with open(self._output, "wb") as output:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "http.server", "--bind", LOCALHOST, "--directory", str(self.root)]
                    + [str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    start_new_session=True,
                )
            try:
                wait_until(self._serving, START_TIMEOUT, "python3 -m http.server", step=0.05)
                return
            except (TimeoutError, RuntimeError):
                text = self._output.read_text(errors="replace")
                self.stop()
                if "Address already in use" not in text or attempt == 2:
                    raise RuntimeError(f"python3 -m http.server did not start: {text[-2000:]}") from None

    def stop(self) -> None:
        """Stop the server, by its PID."""
        if self._process is not None:
            _stop_process(self._process)
            self._process = None

    def gets(self) -> list[tuple[str, int]]:
        """The GETs logged so far (but the start's probe): (path, status), in order."""
        found = []
        for match in re.finditer(r'"GET (\S+) HTTP/[\d.]+" (\d{3})', self._output.read_text(errors="replace")):
            if match[1] != "/.probe":
                found.append((match[1], int(match[2])))
        return found

    def _serving(self) -> bool:
        answer = _probe(self._process, "python3 -m http.server", f"{self.url}/.probe")
        return answer is not None and answer[0] == 200


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port, in a process of its own."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._output = workdir / "moto.log"

    @property
    def endpoint(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            self.port = free_port()
            env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
            with open(self._output, "wb") as output:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", LOCALHOST, "-p", str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            try:
                wait_until(self._serving, START_TIMEOUT * 2, "moto server", step=0.05)
                return
            except (TimeoutError, RuntimeError):
                text = self._output.read_text(errors="replace")
                self.stop()
                if "Address already in use" not in text or attempt == 2:
                    raise RuntimeError(f"moto server did not start: {text[-2000:]}") from None

    def stop(self) -> None:
        if self._process is not None:
            _stop_process(self._process, signal.SIGINT)
            self._process = None

    def reset(self) -> None:
        """Forget every bucket and object."""
        connection = http.client.HTTPConnection(LOCALHOST, self.port, timeout=10)
        try:
            connection.request("POST", "/moto-api/reset")
            connection.getresponse().read()
        finally:
            connection.close()

    def _serving(self) -> bool:
        answer = _probe(self._process, "moto server", f"{self.endpoint}/moto-api/")
        return answer is not None and answer[0] == 200


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",  # object_store (obstore) refuses http:// endpoints without it
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254 for credentials or a region
}


@dataclass(frozen=True, slots=True)
class PutResult:
    etag: str  # quoted, as S3 sends it
    version_id: str | None  # None unless the bucket is versioned


class S3:
    """A boto3 client on a moto server, with the few calls the tests need to lay out buckets."""

    def __init__(self, endpoint: str) -> None:
        import boto3
        from botocore.config import Config

        self.endpoint = endpoint
        self.client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def create_bucket(self, name: str, versioned: bool = False) -> str:
        self.client.create_bucket(Bucket=name)
        if versioned:
            self.client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return name

    def put_object(self, bucket: str, key: str, data: bytes) -> PutResult:
        answer = self.client.put_object(Bucket=bucket, Key=key, Body=data)
        return PutResult(answer["ETag"], answer.get("VersionId"))

    def get_object(self, bucket: str, key: str, byte_range: str | None = None, version_id: str | None = None) -> Any:
        """boto3's answer (``["Body"].read()`` for the bytes); ``byte_range`` like ``"bytes=0-99"``."""
        extra = {"Range": byte_range} if byte_range else {}
        if version_id:
            extra["VersionId"] = version_id
        return self.client.get_object(Bucket=bucket, Key=key, **extra)


# --- the fault proxy --------------------------------------------------------------------------------------


PIECE = 1 << 20  # a body goes through the proxy in pieces of up to this: fewer turns of Python's loop a byte


class _Reader:
    """Buffered reads from a socket: lines, heads, exact lengths."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        piece = self.sock.recv(65536)
        self.buffer += piece
        return bool(piece)

    def read_until(self, marker: bytes, limit: int = 65536) -> bytes | None:
        """Up to and including ``marker``; None at a clean end of stream before any byte."""
        while marker not in self.buffer:
            if len(self.buffer) > limit:
                raise ValueError("HTTP head too large")
            if not self._fill():
                if self.buffer:
                    raise EOFError("connection closed mid-head")
                return None
        end = self.buffer.index(marker) + len(marker)
        piece, self.buffer = self.buffer[:end], self.buffer[end:]
        return piece

    def read_some(self, limit: int) -> bytes:
        if not self.buffer:
            return self.sock.recv(limit)  # straight from the socket: no copy into the buffer and out again
        piece, self.buffer = self.buffer[:limit], self.buffer[limit:]
        return piece


@dataclass(frozen=True, slots=True)
class _Head:
    raw_first: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def without(self, *names: str) -> _Head:
        return _Head(self.raw_first, [(k, v) for k, v in self.headers if k.lower() not in names])

    def encode(self) -> bytes:
        lines = [self.raw_first] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(raw: bytes) -> _Head:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return _Head(lines[0], headers)


def _body_pieces(reader: _Reader, head: _Head, no_body: bool) -> Iterator[bytes]:
    """The raw bytes of a message body as framed by its head (chunk sizes and trailers included)."""
    if no_body:
        return
    if "chunked" in (head.get("transfer-encoding") or "").lower():
        while True:
            line = reader.read_until(b"\r\n")
            if line is None:
                raise EOFError("connection closed mid-body")
            yield line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = reader.read_until(b"\r\n")
                    if trailer is None:
                        raise EOFError("connection closed mid-trailer")
                    yield trailer
                    if trailer == b"\r\n":
                        return
            yield from _fixed(reader, size + 2)
    elif head.get("content-length") is not None:
        yield from _fixed(reader, int(head.get("content-length") or 0))
    elif head.raw_first.startswith("HTTP/"):  # a response without a length runs until the server closes
        while piece := reader.read_some(PIECE):
            yield piece


def _fixed(reader: _Reader, length: int) -> Iterator[bytes]:
    while length > 0:
        piece = reader.read_some(min(length, PIECE))
        if not piece:
            raise EOFError("connection closed mid-body")
        length -= len(piece)
        yield piece


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """One request the proxy saw, and what it did with it."""

    number: int  # 1 for the first request since the proxy started
    method: str
    target: str
    range: str  # the client's Range header, "" when none
    status: int  # what the client got (0 when the connection broke before a status line)
    body_bytes: int  # response body bytes sent to the client
    faults: tuple[str, ...]  # of "delay", "fail", "strip-range", "reset", "stall"


@dataclass(frozen=True, slots=True)
class ProxyStats:
    requests: int = 0  # requests received from clients
    forwarded: int = 0  # requests sent upstream
    delayed: int = 0
    failed: int = 0  # answered by the proxy with an injected status
    resets: int = 0
    stalls: int = 0
    ranges_stripped: int = 0
    body_bytes: int = 0  # response body bytes forwarded to clients
    bytes: int = 0  # everything forwarded to clients, heads included


@dataclass(slots=True)
class _Faults:
    latency: float = 0.0
    fail_count: int = 0
    fail_status: int = 503
    retry_after: str | None = None
    reset_count: int = 0
    reset_after: int = 0
    stall_count: int = 0
    stall_after: int = 0
    stall_seconds: float = 0.0
    ignore_range: bool = False
    rate: float = 0.0  # body bytes a second on every response, 0 unlimited
    on_request: Callable[[int, str, str], None] | None = None


REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of one plain-HTTP upstream, with faults set while it runs; given
    ``tls``, it serves HTTPS with that certificate (clients trust it through the bundle, ``SSL_CERT_FILE``).

    Each client connection gets its own upstream connection; request heads are parsed (to count, delay,
    fail or strip Range) and bodies framed by Content-Length or chunked encoding, so keep-alive works.
    Faults apply to requests that arrive after they are set:

    - ``fail_next(n, status=503, retry_after=None)``: answer the next n requests with that status;
    - ``reset_next(n, after_bytes)``: cut the next n responses longer than ``after_bytes`` with a TCP reset
      once ``after_bytes`` of their body went out;
    - ``stall_next(n, after_bytes, seconds)``: pause those responses mid-body (a server that hangs);
    - ``set_latency(seconds)``: delay every request before forwarding it;
    - ``set_ignore_range(True)``: drop Range and If-Range, so the upstream answers 200 with the whole body;
    - ``set_rate(bytes_per_second)``: send bodies no faster than that (a slow link), 0 unlimited;
    - ``on_request(callback)``: call ``callback(number, method, target)`` before each request goes upstream,
      e.g. to replace the object after the header was read.
    """

    def __init__(self, upstream: str, tls: TlsFiles | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname != LOCALHOST:
            raise ValueError(f"{upstream}: the proxy fronts plain http on {LOCALHOST} only")
        self.upstream = (LOCALHOST, parts.port or 80)
        self._tls: ssl.SSLContext | None = None
        if tls is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(tls.cert, tls.key)
        self._listener = socket.create_server((LOCALHOST, 0))
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._faults = _Faults()
        self._stats = ProxyStats()
        self._log: list[ProxyRequest] = []
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{LOCALHOST}:{self.port}"

    def start(self) -> FaultProxy:
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy-accept")
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop accepting, break every open connection (a stalled response too), join the threads."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux; it also polls every 0.1 s
        if self._acceptor is not None:
            self._acceptor.join(STOP_TIMEOUT)  # no connection is added after this
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + STOP_TIMEOUT
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        for sock in sockets:
            sock.close()

    def fail_next(self, count: int, status: int = 503, retry_after: int | None = None) -> None:
        with self._lock:
            self._faults.fail_count = count
            self._faults.fail_status = status
            self._faults.retry_after = None if retry_after is None else str(retry_after)

    def reset_next(self, count: int = 1, after_bytes: int = 0) -> None:
        with self._lock:
            self._faults.reset_count, self._faults.reset_after = count, after_bytes

    def stall_next(self, count: int = 1, after_bytes: int = 0, seconds: float = 60.0) -> None:
        with self._lock:
            self._faults.stall_count, self._faults.stall_after = count, after_bytes
            self._faults.stall_seconds = seconds

    def set_latency(self, seconds: float) -> None:
        with self._lock:
            self._faults.latency = seconds

    def set_ignore_range(self, ignore: bool = True) -> None:
        with self._lock:
            self._faults.ignore_range = ignore

    def set_rate(self, bytes_per_second: float) -> None:
        with self._lock:
            self._faults.rate = bytes_per_second

    def on_request(self, callback: Callable[[int, str, str], None] | None) -> None:
        with self._lock:
            self._faults.on_request = callback

    def clear_faults(self) -> None:
        with self._lock:
            self._faults = _Faults()

    def stats(self) -> ProxyStats:
        with self._lock:
            return self._stats

    def requests(self) -> list[ProxyRequest]:
        with self._lock:
            return list(self._log)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="fault-proxy")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self._spawn(self._serve, self._track(client))

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            if self._tls is not None:
                plain, client = client, self._tls.wrap_socket(client, server_side=True)  # detaches plain
                with self._lock:
                    self._sockets.discard(plain)
                    self._sockets.add(client)
            reader = _Reader(client)
            upstream_reader: _Reader | None = None
            while not self._stopping.is_set():
                raw = reader.read_until(b"\r\n\r\n")
                if raw is None:
                    return
                request = _parse_head(raw)
                method, target = (request.raw_first.split(" ") + ["", ""])[:2]
                if (request.get("expect") or "").lower() == "100-continue":
                    # The body is read here before anything goes upstream: say go on now (boto3 waits 1 s).
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    request = request.without("expect")
                body = b"".join(_body_pieces(reader, request, no_body=False))
                client_range = request.get("range") or ""
                with self._lock:
                    self._stats = replace(self._stats, requests=self._stats.requests + 1)
                    number = self._stats.requests
                    faults = self._faults
                    callback, latency, strip = faults.on_request, faults.latency, faults.ignore_range
                    fail = faults.fail_count > 0
                    if fail:
                        faults.fail_count -= 1
                    status, retry_after = faults.fail_status, faults.retry_after
                applied: list[str] = []
                if callback is not None:
                    callback(number, method, target)
                if latency > 0:
                    applied.append("delay")
                    self._bump("delayed")
                    self._stopping.wait(latency)
                if fail:
                    applied.append("fail")
                    self._bump("failed")
                    self._answer(client, status, retry_after)
                    self._record(ProxyRequest(number, method, target, client_range, status, 0, tuple(applied)))
                    continue
                if strip and (request.get("range") or request.get("if-range")):
                    applied.append("strip-range")
                    self._bump("ranges_stripped")
                    request = request.without("range", "if-range")
                if upstream is None:
                    upstream = self._track(socket.create_connection(self.upstream, timeout=30))
                    upstream.settimeout(None)
                    upstream_reader = _Reader(upstream)
                assert upstream_reader is not None
                upstream.sendall(request.encode() + body)
                self._bump("forwarded")
                record = ProxyRequest(number, method, target, client_range, 0, 0, tuple(applied))
                keep = self._relay(client, upstream_reader, record)
                client_close = (request.get("connection") or "").lower() == "close"
                if not keep or client_close:
                    return
        except (OSError, EOFError, ValueError):
            return
        finally:
            if upstream is not None:
                self._forget(upstream)
            self._forget(client)

    def _relay(self, client: socket.socket, upstream: _Reader, record: ProxyRequest) -> bool:
        """Send one response from upstream to the client, with its faults; whether the connection goes on."""
        while True:
            raw = upstream.read_until(b"\r\n\r\n")
            if raw is None:
                raise EOFError("upstream closed before answering")
            response = _parse_head(raw)
            status = int(response.raw_first.split(" ")[1])
            if status >= 200 or status == 101:
                break  # the final head goes out with the body, below
            client.sendall(raw)
            self._bump("bytes", len(raw))
        no_body = record.method == "HEAD" or status in (204, 304)
        length = response.get("content-length")

        def longer_than(size: int) -> bool:
            # A response of unknown length (chunked, until close) may not reach the cut: it takes its turn anyway.
            return not no_body and (length is None or int(length) > size)

        applied = list(record.faults)
        reset_at = stall_at = -1
        stall_seconds = 0.0
        with self._lock:
            faults = self._faults
            rate = faults.rate
            if faults.reset_count > 0 and longer_than(faults.reset_after):
                faults.reset_count -= 1
                reset_at = faults.reset_after
            if faults.stall_count > 0 and longer_than(faults.stall_after):
                faults.stall_count -= 1
                stall_at, stall_seconds = faults.stall_after, faults.stall_seconds
        # Every count is made before the bytes it counts go out, and the request is recorded before its last
        # bytes do: a client that has read the whole answer finds it in stats() and requests() at once.
        self._bump("bytes", len(raw))
        client.sendall(raw)
        sent = 0
        pieces = _body_pieces(upstream, response, no_body)
        following = next(pieces, None)
        if following is None:
            self._record(replace(record, status=status, body_bytes=0, faults=tuple(applied)))
        while following is not None:
            piece, following = following, next(pieces, None)
            for cut_at, kind in ((stall_at, "stall"), (reset_at, "reset")):
                if 0 <= cut_at < sent + len(piece):
                    head_part = piece[: cut_at - sent]
                    self._bump("body_bytes", len(head_part))
                    self._bump("bytes", len(head_part))
                    client.sendall(head_part)
                    sent += len(head_part)
                    piece = piece[len(head_part) :]
                    applied.append(kind)
                    if kind == "reset":
                        self._bump("resets")
                        self._record(replace(record, status=status, body_bytes=sent, faults=tuple(applied)))
                        # SO_LINGER 0: close() sends RST, so the client sees a reset, not a clean end.
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return False
                    self._bump("stalls")
                    stall_at = -1
                    self._stopping.wait(stall_seconds)
            self._bump("body_bytes", len(piece))
            self._bump("bytes", len(piece))
            sent += len(piece)
            if following is None:
                self._record(replace(record, status=status, body_bytes=sent, faults=tuple(applied)))
            if rate > 0:
                self._trickle(client, piece, rate)
            else:
                client.sendall(piece)
        framed = no_body or length is not None or "chunked" in (response.get("transfer-encoding") or "").lower()
        return framed and (response.get("connection") or "").lower() != "close"

    def _trickle(self, client: socket.socket, piece: bytes, rate: float) -> None:
        step = 4096
        for start in range(0, len(piece), step):
            client.sendall(piece[start : start + step])
            if self._stopping.wait(step / rate):
                return

    def _answer(self, client: socket.socket, status: int, retry_after: str | None) -> None:
        body = f"injected {status}\n".encode()
        head = f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
        head += f"Content-Length: {len(body)}\r\n"
        if retry_after is not None:
            head += f"Retry-After: {retry_after}\r\n"
        message = head.encode() + b"\r\n" + body
        client.sendall(message)
        self._bump("bytes", len(message))

    def _bump(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._stats = replace(self._stats, **{name: getattr(self._stats, name) + amount})

    def _record(self, entry: ProxyRequest) -> None:
        with self._lock:
            self._log.append(entry)
