"""An OCI registry (the distribution API) as stfs reads it: references, credentials, tokens, manifests, blob ranges.

* **References**: ``oci://HOST[:PORT]/REPO[:TAG]`` or ``…@sha256:DIGEST``; Docker Hub is ``docker.io`` (API host
  ``registry-1.docker.io``, ``library/`` before a one-part name). HTTPS, plain HTTP only for a loopback host or
  where asked (``plain_http``), as Docker treats them.
* **Auth** as docker, podman and oras answer it: anonymous first; a 401's ``WWW-Authenticate`` challenge is
  answered, ``Bearer`` by fetching a token from its realm (with Basic credentials when there are some), ``Basic``
  directly; a token is fetched again shortly before it expires, and at once on a 401. Credentials come from
  ``REGISTRY_AUTH_FILE``, else podman's ``$XDG_RUNTIME_DIR/containers/auth.json``, else Docker's
  ``config.json``; they are secrets: in no message, log line or key.
* **Blobs** are read by ranged GETs into memory the caller gives (``BlobClient``, a ``RemoteFiles`` client). A
  registry that hands blobs to a CDN or S3 answers with a redirect: it is asked once per blob (a HEAD, not
  followed), then its ranges are read from there, ``Range`` kept, the token dropped where the host changes.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import logging
import os
import re
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass

from .. import errors
from .failures import RETRY, describe
from .http_client import HttpClient, PlacedClient, StatusError, https_context

log = logging.getLogger(__name__)

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
DOCKER_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", DOCKER_HUB_API, DOCKER_HUB)
MAX_MANIFEST = 4 << 20  # distribution refuses larger manifests
TOKEN_LIFETIME = 60  # seconds a token lives when its issuer does not say (the distribution spec's default)
RENEW_BEFORE = 0.9  # a token is fetched again once this share of its lifetime has passed
REDIRECTS = (301, 302, 303, 307, 308)

_REPOSITORY = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?$")
_CHALLENGE_PARAM = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


class RegistryError(errors.SourceError):
    """The registry refused or did not answer (one line: the reference or host, and why; never a secret)."""


class AuthError(RegistryError):
    """The registry asks for credentials that stfs does not have, or refused the ones it has."""


@dataclass(frozen=True, slots=True)
class Reference:
    """A SOURCE naming a registry's artifact: ``host`` as written, its ``repository``, and a ``tag`` or ``digest``."""

    host: str
    repository: str
    tag: str | None
    digest: str | None
    plain_http: bool

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.host == DOCKER_HUB else self.host

    @property
    def origin(self) -> str:
        return ("http://" if self.plain_http else "https://") + self.api_host

    @property
    def shown(self) -> str:
        """The reference as SOURCE named it (a tag or a digest)."""
        return f"oci://{self.host}/{self.repository}" + (f"@{self.digest}" if self.digest else f":{self.tag}")

    def pinned(self, digest: str) -> str:
        """The reference pinned to a manifest's digest: the root of every key of the mount."""
        return f"oci://{self.host}/{self.repository}@{digest}"


def parse_reference(text: str, plain_http: bool = False) -> Reference:
    """``oci://HOST[:PORT]/REPO[:TAG]`` or ``oci://HOST[:PORT]/REPO@sha256:DIGEST``; a ``SourceError`` if it is not
    one. Plain HTTP for a loopback host, or with ``plain_http``."""
    rest = text[len("oci://") :] if text.startswith("oci://") else text
    host, _, name = rest.partition("/")
    shape = "oci://HOST[:PORT]/REPOSITORY[:TAG] or oci://HOST[:PORT]/REPOSITORY@sha256:DIGEST"
    if not host or not name or _HOST.match(host) is None:
        raise errors.SourceError(f"{text}: not {shape}")
    digest = tag = None
    if "@" in name:
        name, _, digest = name.partition("@")
        if _DIGEST.match(digest) is None:
            raise errors.SourceError(f"{text}: {digest!r} is not a sha256 digest (sha256: and 64 hex digits)")
    else:
        last = name.rfind("/")
        colon = name.rfind(":")
        if colon > last:
            name, tag = name[:colon], name[colon + 1 :]
            if _TAG.match(tag) is None:
                raise errors.SourceError(f"{text}: {tag!r} is not a tag (letters, digits, _ . -; at most 128)")
        else:
            tag = "latest"
    name = name.strip("/")
    if host == DOCKER_HUB and "/" not in name:
        name = "library/" + name
    if _REPOSITORY.match(name) is None:
        raise errors.SourceError(f"{text}: {name!r} is not a repository name (lower case, digits, . _ - and /)")
    return Reference(host, name, tag, digest, plain_http or is_loopback(host))


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ``[::1]``, with or without a port."""
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.find("]")]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# -- credentials ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Credentials:
    """A user and password for a registry, and the file they came from (named in messages; the password never)."""

    user: str
    password: str
    file: str

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()


def auth_files() -> list[str]:
    """The files credentials are looked up in, in order: ``REGISTRY_AUTH_FILE`` alone where set, else podman's
    ``auth.json`` and Docker's ``config.json``."""
    named = os.environ.get("REGISTRY_AUTH_FILE")
    if named:
        return [named]
    files = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        files.append(os.path.join(runtime, "containers", "auth.json"))
    files.append(os.path.join(os.path.expanduser("~"), ".config", "containers", "auth.json"))
    docker = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    files.append(os.path.join(docker, "config.json"))
    return files


class HelperError(AuthError):
    """A credential helper that failed (the message names it and the host, never what it printed)."""


def credentials_for(host: str) -> Credentials | None:
    """The credentials for ``host`` (Docker Hub under its other names too) from the first auth file that has some:
    its credential helper's (``credHelpers`` for the host, else ``credsStore``), as docker runs them, else its
    ``auths`` entry; ``None`` where none has any. A helper that fails is a ``HelperError``."""
    wanted = DOCKER_HUB_KEYS if host == DOCKER_HUB else (host,)
    for path in auth_files():
        try:
            with open(path, encoding="utf-8") as stream:
                document = json.load(stream)
        except (OSError, ValueError):
            continue
        if not isinstance(document, dict):
            continue
        helpers = document.get("credHelpers")
        helper = next((helpers[key] for key in wanted if key in helpers), None) if isinstance(helpers, dict) else None
        helper = helper or document.get("credsStore")
        if isinstance(helper, str) and helper:
            found = _from_helper(helper, host, path)
            if found is not None:
                return found
        auths = document.get("auths")
        if not isinstance(auths, dict):
            continue
        for key, entry in auths.items():
            if _auth_key(str(key)) in wanted and isinstance(entry, dict):
                found = _entry_credentials(entry, path)
                if found is not None:
                    return found
    return None


HELPER_TIMEOUT = 30.0  # seconds a credential helper may take (a keychain may ask its user)
NOT_FOUND = "credentials not found"  # what docker's helpers print for a server they hold nothing for


def _from_helper(name: str, host: str, path: str) -> Credentials | None:
    """``docker-credential-NAME get`` with the server on standard input, as docker runs it: its JSON ``Username``
    and ``Secret``; ``None`` where it holds nothing for the server."""
    program = f"docker-credential-{name}"
    server = DOCKER_HUB_KEYS[0] if host == DOCKER_HUB else host
    where = f"{host}: the credential helper {program} (named in {path})"
    try:
        done = subprocess.run(
            [program, "get"], input=server.encode(), capture_output=True, timeout=HELPER_TIMEOUT, check=False
        )
    except FileNotFoundError:
        raise HelperError(f"{where} is not installed (not on PATH)") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HelperError(f"{where} did not run: {type(exc).__name__}") from None
    if done.returncode != 0:
        if NOT_FOUND in done.stdout.decode(errors="replace").lower():
            return None
        raise HelperError(f"{where} failed (exit status {done.returncode})")
    try:
        answer = json.loads(done.stdout)
        user, secret = answer["Username"], answer["Secret"]
        if not isinstance(user, str) or not isinstance(secret, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise HelperError(f"{where} answered something else than its JSON Username and Secret") from None
    return Credentials(user, secret, program)


def _auth_key(key: str) -> str:
    """An ``auths`` key as a host: ``https://host/v1/`` and ``host`` alike."""
    if "://" in key:
        return key if key in DOCKER_HUB_KEYS else urllib.parse.urlsplit(key).netloc
    return key.split("/", 1)[0]


def _entry_credentials(entry: dict, path: str) -> Credentials | None:
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return Credentials(user, password, path)
    if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
        return Credentials(entry["username"], entry["password"], path)
    return None


# -- the registry -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


class Registry:
    """The distribution API of one repository: authorised requests, manifests, blob places (module docstring)."""

    def __init__(self, reference: Reference, timeout: float) -> None:
        self.reference = reference
        self.timeout = timeout
        self.requests = 0  # manifests, tokens and HEADs: what ``transfer`` counts besides the ranges
        self._helper_error: HelperError | None = None
        try:
            self._credentials = credentials_for(reference.host)
        except HelperError as exc:  # said where the registry asks for credentials: an open one needs none
            self._credentials, self._helper_error = None, exc
        self._authorization: str | None = None
        self._renew_at = float("inf")
        self._bearer: dict[str, str] | None = None  # the challenge's realm, service and scope, for renewals
        self._lock = threading.RLock()  # held while a token is fetched, which counts its request under it too
        self._context = https_context() if not reference.plain_http else None

    # -- authorised requests

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header for the next request (a token renewed if it is about to expire)."""
        with self._lock:
            if self._bearer is not None and time.monotonic() >= self._renew_at:
                self._fetch_token()
            return {"Authorization": self._authorization} if self._authorization else {}

    def renew(self) -> None:
        """Fetch a new token now (a request was refused with 401: it expired, or was revoked)."""
        with self._lock:
            if self._bearer is not None:
                self._fetch_token()

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> Answer:
        """``method`` of ``path`` on the registry, authorised (a 401's challenge answered once); redirects are
        returned, not followed. Failures to reach it are retried until ``timeout`` (not a refused connection)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        answered = False
        while True:
            try:
                answer = self._send(method, self.reference.origin + path, {**self.headers(), **(headers or {})})
            except OSError as exc:
                failure = describe(exc)
                if failure.kind != RETRY or time.monotonic() + delay >= deadline:
                    raise RegistryError(
                        f"{self.reference.shown}: the registry does not answer: {failure.cause}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if answer.status == 401 and not answered:
                answered = True
                with self._lock:
                    self._answer(answer.headers.get("WWW-Authenticate", ""))
                continue
            if answer.status in (429, 500, 502, 503, 504) and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            return answer

    def _send(self, method: str, url: str, headers: dict[str, str]) -> Answer:
        parts = urllib.parse.urlsplit(url)
        connection: http.client.HTTPConnection
        if parts.scheme == "https":
            connection = http.client.HTTPSConnection(parts.netloc, timeout=self.timeout, context=self._context)
        else:
            connection = http.client.HTTPConnection(parts.netloc, timeout=self.timeout)
        try:
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            connection.request(method, target, headers={"Accept-Encoding": "identity", **headers})
            response = connection.getresponse()
            body = response.read(MAX_MANIFEST + 1) if method != "HEAD" else b""
            with self._lock:
                self.requests += 1
            return Answer(response.status, response.headers, body)
        finally:
            connection.close()

    def _answer(self, challenge: str) -> None:
        """Answer a 401's ``WWW-Authenticate`` (the lock is held); an ``AuthError`` where it cannot be."""
        scheme, _, rest = challenge.strip().partition(" ")
        params = {
            found[1].lower(): found[2] if found[2] is not None else found[3]
            for found in _CHALLENGE_PARAM.finditer(rest)
        }
        host = self.reference.host
        if scheme.lower() == "basic":
            if self._credentials is None:
                raise AuthError(f"{host}: the registry asks for a user and password; {self._where_credentials()}")
            if self._authorization == self._credentials.basic():
                raise self._refused()
            self._authorization = self._credentials.basic()
            return
        if scheme.lower() != "bearer" or not params.get("realm"):
            raise AuthError(f"{host}: the registry asks for authentication stfs does not speak ({scheme or 'none'})")
        params.setdefault("scope", f"repository:{self.reference.repository}:pull")
        self._bearer = params
        self._fetch_token()

    def _fetch_token(self) -> None:
        """A token from the challenge's realm, with the Basic credentials where there are some (the lock is held)."""
        assert self._bearer is not None
        query = urllib.parse.urlencode(
            {key: self._bearer[key] for key in ("service", "scope") if self._bearer.get(key)}
        )
        url = self._bearer["realm"] + ("&" if "?" in self._bearer["realm"] else "?") + query
        headers = {"Authorization": self._credentials.basic()} if self._credentials is not None else {}
        realm_host = urllib.parse.urlsplit(url).hostname or "?"
        try:
            answer = self._send("GET", url, headers)
        except OSError as exc:
            raise RegistryError(
                f"{self.reference.host}: its token service ({realm_host}) does not answer: {describe(exc).cause}"
            ) from None
        if answer.status in (401, 403):
            if self._credentials is not None:
                raise self._refused()
            raise AuthError(f"{self.reference.host}: the registry needs credentials; {self._where_credentials()}")
        if answer.status != 200:
            raise RegistryError(f"{self.reference.host}: its token service answered HTTP {answer.status}")
        try:
            document = json.loads(answer.body)
            token = document.get("token") or document.get("access_token")
            lifetime = float(document.get("expires_in") or TOKEN_LIFETIME)
        except (ValueError, AttributeError, TypeError):
            token, lifetime = None, 0.0
        if not isinstance(token, str) or not token:
            raise RegistryError(f"{self.reference.host}: its token service gave no token")
        self._authorization = f"Bearer {token}"
        self._renew_at = time.monotonic() + max(1.0, lifetime) * RENEW_BEFORE

    def _refused(self) -> AuthError:
        who = self._credentials
        assert who is not None
        return AuthError(
            f"{self.reference.host}: the registry refuses the credentials of user {who.user!r} ({who.file})"
        )

    def _where_credentials(self) -> str:
        if self._helper_error is not None:
            return str(self._helper_error).partition(": ")[2]
        return f"none found for it in {', '.join(auth_files())} (docker login, podman login or oras login write them)"

    # -- manifests and blobs

    def manifest(self, reference: str, accept: str) -> tuple[bytes, str | None]:
        """The manifest ``reference`` (a tag or digest) names, as bytes, and the media type the registry gave."""
        path = f"/v2/{self.reference.repository}/manifests/{reference}"
        answer = self.request("GET", path, {"Accept": accept})
        if answer.status == 404:
            raise RegistryError(f"{self.reference.shown}: {_not_found(answer.body, reference)}")
        if answer.status == 401:
            if self._credentials is None:
                raise AuthError(f"{self.reference.host}: the registry needs credentials; {self._where_credentials()}")
            who = self._credentials
            raise AuthError(
                f"{self.reference.shown}: the registry refuses access to user {who.user!r} ({who.file}) (HTTP 401)"
            )
        if answer.status == 403:
            raise AuthError(f"{self.reference.shown}: access denied (HTTP 403)")
        if answer.status != 200:
            raise RegistryError(f"{self.reference.shown}: the registry answered HTTP {answer.status} for the manifest")
        if len(answer.body) > MAX_MANIFEST:
            raise RegistryError(f"{self.reference.shown}: the manifest is larger than {MAX_MANIFEST} bytes")
        return answer.body, answer.headers.get("Content-Type")

    def blob_path(self, digest: str) -> str:
        return f"/v2/{self.reference.repository}/blobs/{digest}"

    def blob_exists(self, digest: str) -> bool:
        """Whether the registry still holds the blob (a HEAD; a redirect counts as yes)."""
        answer = self.request("HEAD", self.blob_path(digest))
        if answer.status == 404:
            return False
        if answer.status < 400:
            return True
        raise OSError(f"HEAD of blob {digest}: the registry answered with status code: {answer.status}")


def _not_found(body: bytes, reference: str) -> str:
    """What a 404 of a manifest means, from the registry's error code (distribution's JSON errors)."""
    try:
        codes = {error.get("code") for error in json.loads(body).get("errors", [])}
    except (ValueError, AttributeError, TypeError):
        codes = set()
    if "NAME_UNKNOWN" in codes:
        return "no such repository (or no access to it)"
    if reference.startswith("sha256:"):
        return "no such manifest in the repository, or no such repository"
    return f"no such tag {reference!r} in the repository, or no such repository"


class BlobClient(PlacedClient):
    """Ranged GETs of a repository's blobs into memory given (``RemoteFiles``'s client): from the registry, with its
    token (renewed on a 401), or from where it redirects a blob (asked once per blob, a HEAD), without the token
    where the host changes."""

    def __init__(self, registry: Registry, timeout: float) -> None:
        super().__init__({}, timeout)
        self.registry = registry
        self._first = HttpClient(registry.reference.origin, {}, timeout)

    def _headers(self, client: HttpClient) -> dict[str, str] | None:
        return self.registry.headers() if client is self._first else None  # the token goes to its host only

    def _ask_again(self, client: HttpClient, status: int) -> bool:
        if client is not self._first:
            return True
        if status == 401:  # the token expired, or was revoked
            self.registry.renew()
            return True
        return False

    def _find(self, path: str) -> tuple[HttpClient, str, str]:
        """Where the blob ``path`` (``…/sha256:HEX``) is: the registry's own path, or where it redirects."""
        assert self._first is not None
        digest = path.rsplit("/", 1)[-1]
        own = self.registry.blob_path(digest)
        answer = self.registry.request("HEAD", own)
        location = answer.headers.get("Location")
        if answer.status in REDIRECTS and location:
            url = urllib.parse.urljoin(self.registry.reference.origin + own, location)
            parts = urllib.parse.urlsplit(url)
            if f"{parts.scheme}://{parts.netloc}" == self.registry.reference.origin:
                return self._first, parts.path, parts.query
            return self._client_at(url)
        if answer.status == 404:
            raise StatusError(f"blob {digest}: the registry answered with status code: 404 Not Found", 404)
        return self._first, own, ""
