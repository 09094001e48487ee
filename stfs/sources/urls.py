"""SOURCE URLs: ``http(s)://``, ``s3://`` and ``hf://``, each a ``Transport`` for ``RemoteFiles``.

Keys are URLs without credentials (what ``user.safetensors.file`` shows): a password in an HTTP URL
becomes an ``Authorization`` header, ``HF_TOKEN`` a bearer token, and S3 keys come from the usual AWS
chain (environment, profile); none of them reaches a key, a log line or an error message.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import re
import urllib.parse
from typing import Any

from .. import errors
from .base import DEFAULT_CACHE_SIZE, DEFAULT_TIMEOUT, ByteSource, Kind, shown_url, url_problem
from .disk_cache import open_disk_cache
from .failures import describe, first_line
from .http_client import HttpClient, ResolvingClient, SignedClient, https_context
from .remote import RemoteFiles
from .transport import Listing, Transport

log = logging.getLogger(__name__)

# A revision ends at the first "/", except the Hub's special refs, whose names hold two (huggingface_hub's
# HfFileSystem reads them the same way): hf://org/repo@refs/pr/1/sub/x.safetensors is PATH sub/x.safetensors of
# revision refs/pr/1. Any revision may also be percent-encoded (refs%2Fpr%2F1, a branch feature%2Fx).
_HUB_REPO = re.compile(
    r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<revision>refs/pr/\d+|refs/convert/\w+|[^/]+))?(?:/(?P<path>.*))?$"
)


def _client_options(timeout: float, headers: dict[str, str] | None = None, allow_http: bool = True) -> Any:
    options: dict[str, Any] = {
        "allow_http": allow_http,
        "connect_timeout": f"{max(1, int(timeout))}s",
        "timeout": f"{max(1, int(timeout))}s",
    }
    certificates = os.environ.get("SSL_CERT_FILE")
    if certificates and os.path.isfile(certificates):
        with open(certificates, "rb") as stream:
            options["root_certificate"] = stream.read()
    if headers:
        options["default_headers"] = headers
    return options


SIGNED_FOR = 3600.0  # seconds an S3 URL is presigned for (used for half of that)
# RemoteFiles retries itself (until --timeout, counting every request it makes): obstore must not retry too.
NO_RETRIES: Any = {"max_retries": 0}
# A server with gzip on answers a ranged GET with the whole body, compressed, unless asked for identity.
IDENTITY = {"Accept-Encoding": "identity"}


class HttpTransport(Transport):
    """One HTTP(S) server; it cannot list folders (SOURCE names a file or an index).

    ``query``, a presigned URL's (``X-Amz-Signature=…``), goes with every request and is a secret: not in a
    key, and cut out of every error; once the server refuses it (403) it has expired, and every later read
    fails at once without asking again (``refuse_if_expired``)."""

    def __init__(self, base: str, headers: dict[str, str], timeout: float, query: str = "") -> None:
        self.base = base
        self.headers = headers
        self.timeout = timeout
        self.query = query
        self.expired = False
        self._client: HttpClient | None = None

    def make_store(self) -> Any:
        from obstore.store import HTTPStore

        # obstore keeps the base URL's query on every request it makes (the path is appended before it)
        return HTTPStore(
            self.base + (f"?{self.query}" if self.query else ""),
            client_options=_client_options(self.timeout, {**IDENTITY, **self.headers}),
            retry_config=NO_RETRIES,
        )

    def store_path(self, key: str) -> str:
        # A URL's path may be percent-encoded (`my%20model.safetensors`, as a browser copies it): obstore encodes
        # the name it is given, so it gets the name decoded; stfs's own client sends the path as the URL spells it.
        return urllib.parse.unquote(self.path(key))

    def client(self) -> HttpClient:
        if self._client is None:
            self._client = HttpClient(self.base, self.headers, self.timeout, self.query)
        return self._client

    def prepare(self) -> None:
        if self.base.startswith("https:"):
            https_context()

    def refuse_if_expired(self) -> None:
        if self.expired:
            raise PermissionError(self._expired_message())

    def shown(self, exc: Exception) -> Exception:
        if not self.query:
            return exc
        text = str(exc)
        secret = self.query in text or urllib.parse.unquote(self.query) in text
        if _status_of(exc, text) == 403:
            if not self.expired:
                self.expired = True
            return PermissionError(self._expired_message())
        if not secret:
            return exc
        for form in (self.query, urllib.parse.unquote(self.query)):
            text = text.replace("?" + form, "").replace(form, "")
        try:
            return type(exc)(text)
        except Exception:
            return OSError(text)

    def _expired_message(self) -> str:
        return (
            f"{self.base}: the server refuses the presigned URL (status code: 403 Forbidden): it has expired or its "
            "signature is not valid; mount it again with a new URL"
        )


def _status_of(exc: Exception, text: str) -> int:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    match = re.search(r"status code: (\d{3})", text)
    return int(match.group(1)) if match else (403 if type(exc).__name__ == "PermissionDeniedError" else 0)


class S3Transport(Transport):
    """One S3 bucket (or S3-compatible store: ``AWS_ENDPOINT_URL``), credentials from the usual AWS chain."""

    def __init__(self, bucket: str, timeout: float) -> None:
        self.bucket = bucket
        self.base = f"s3://{bucket}"
        self.endpoint = endpoint_from(("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))  # None: AWS's own
        self.timeout = timeout
        self._listings: dict[str, list[str]] = {}  # prefix -> its keys: listed once, the mount's snapshot
        self._listed: dict[str, Listing] = {}  # key -> what the listing said of it
        self._client: SignedClient | None = None
        self._unsigned = False  # nothing signs S3's requests here: obstore reads them
        self._signer: Any = None  # the store that signs: obstore's, made in the daemon

    def make_store(self) -> Any:
        from obstore.store import S3Store

        config: Any = {}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            config["region"] = region
        return S3Store(
            self.bucket,
            config=config,
            client_options=_client_options(self.timeout),
            retry_config=NO_RETRIES,
        )

    def client(self) -> SignedClient | None:
        """Ranged GETs of URLs obstore presigns (a copy fewer than obstore's GET: the body is read into the slot);
        ``RemoteFiles`` reads an object pinned by its VersionId through obstore still (a version in the query would
        need signing with it). ``None`` (obstore's unsigned GETs) where requests go unsigned (``AWS_SKIP_SIGNATURE``,
        a public bucket) or nothing can sign them (no credentials)."""
        if self._client is None and not self._unsigned:
            self._unsigned = os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true")
            try:
                if not self._unsigned:
                    self._sign("probe", 60)  # credentials at hand or fetched once (an instance's): no request of S3
            except Exception as exc:
                log.debug("%s: S3 reads go through obstore (cannot presign: %s)", self.base, first_line(exc))
                self._unsigned = True
            if self._unsigned:
                return None
            self._client = SignedClient(self._sign, SIGNED_FOR, self.timeout)
        return self._client

    def prepare(self) -> None:
        if self.endpoint is None or self.endpoint.startswith("https:"):  # AWS's own endpoints are HTTPS
            https_context()

    def _sign(self, path: str, lifetime: float) -> str:
        import obstore

        if self._signer is None:
            self._signer = self.make_store()
        return str(obstore.sign(self._signer, "GET", path, datetime.timedelta(seconds=lifetime)))

    def list(self, store: Any, key: str) -> list[str] | None:
        import obstore

        prefix = self.path(key).strip("/")
        if prefix in self._listings:
            return self._listings[prefix]
        keys = []
        for batch in obstore.list(store, prefix or None):
            for meta in batch:
                found = f"{self.base}/{meta['path']}"
                if found.endswith("/"):
                    continue
                keys.append(found)
                modified = meta.get("last_modified")
                etag = meta.get("e_tag")
                self._listed[found] = Listing(
                    Kind.FILE,
                    int(meta["size"]),
                    etag,
                    etag,
                    int(modified.timestamp() * 1e9) if modified is not None else 0,
                )
        self._listings[prefix] = sorted(keys)
        return self._listings[prefix]

    def describe(self, key: str) -> Listing | None:
        return self._listed.get(key)


class HubTransport(Transport):
    """A Hugging Face Hub repository pinned to one commit; its file list comes with the commit."""

    def __init__(
        self,
        repo: str,
        commit: str,
        files: dict[str, str],
        endpoint: str,
        token: str | None,
        timeout: float,
        revision: str | None = None,
        sizes: dict[str, int] | None = None,
        mtime_ns: int = 0,
        sha256s: dict[str, str] | None = None,
    ) -> None:
        self.repo = repo
        self.commit = commit
        self.revision = revision or commit  # what SOURCE named: a branch moves on, the mount stays at the commit
        self.oids = files  # path -> the Hub's ETag of it at the commit (LFS sha256 or git blob id)
        self.sizes = sizes or {}  # path -> its size, from the file list
        self.sha256s = sha256s or {}  # path -> the sha256 of an LFS file, from the file list
        self.mtime_ns = mtime_ns  # the repository's last change: every file's mtime when pinned from the list
        self.files = sorted(files)
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.base = f"hf://{repo}@{commit}"
        self._client: ResolvingClient | None = None

    def client(self) -> ResolvingClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            prefix = f"/{self.repo}/resolve/{self.commit}/"
            self._client = ResolvingClient(self.endpoint, prefix, headers, self.timeout)
        return self._client

    def sha256(self, key: str) -> str | None:
        return self.sha256s.get(self.path(key))

    def lookups(self) -> int:
        return self._client.lookups if self._client is not None else 0

    def prepare(self) -> None:
        if self.endpoint.startswith("https:"):
            https_context()  # the Hub's, and its CDN's where it points there (the Hub's own does)

    def make_store(self) -> Any:
        from obstore.store import HTTPStore

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return HTTPStore(
            f"{self.endpoint}/{self.repo}/resolve/{self.commit}",
            client_options=_client_options(self.timeout, {**IDENTITY, **headers}),
            retry_config=NO_RETRIES,
        )

    def list(self, store: Any, key: str) -> list[str] | None:
        prefix = self.path(key)
        prefix = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return [f"{self.base}/{name}" for name in self.files if name.startswith(prefix)]

    def describe(self, key: str) -> Listing | None:
        path = self.path(key).rstrip("/")
        if not path or any(name.startswith(path + "/") for name in self.files):
            return Listing(Kind.FOLDER)
        if path not in self.oids:
            return Listing(None)
        # A file of a commit never changes: the commit in its URL pins it, no If-Match needed; its oid names it.
        return Listing(Kind.FILE, self.sizes.get(path), None, self.oids[path] or self.commit, self.mtime_ns)

    def still_there(self, store: Any, key: str, etag: str | None, version: str | None, size: int) -> bool:
        """Whether the revision SOURCE named (a branch moves) still holds this file as it was at the pinned commit:
        one HEAD of its ``resolve/`` URL, whose redirect carries the file's ETag (not followed)."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        path = self.path(key)
        url = hf_hub_url(self.repo, path, revision=self.revision, endpoint=self.endpoint)
        try:
            meta = get_hf_file_metadata(url, token=self.token or False, timeout=self.timeout)
        except (EntryNotFoundError, RevisionNotFoundError, RepositoryNotFoundError):
            raise FileNotFoundError(key) from None
        pinned = self.oids.get(path)
        return not pinned or (meta.etag or "").strip('"') == pinned


def open_remote(
    text: str,
    *,
    cache_size: int = DEFAULT_CACHE_SIZE,
    timeout: float = DEFAULT_TIMEOUT,
    cache_dir: str | None = None,
    cache_dir_size: int | None = None,
    ranges_required: bool = False,
    plain_http: bool = False,
) -> tuple[ByteSource, str]:
    """The source a SOURCE URL names, and its key there (the URL without credentials, Hub revision or registry
    manifest pinned); ``ranges_required``: refuse a server that ignores Range (a mount) rather than stream from the
    start (info); ``plain_http``: a registry not on a loopback host asked over HTTP."""
    disk = open_disk_cache(cache_dir, cache_dir_size)
    if text.startswith("oci://"):
        from .oci import open_registry

        return open_registry(
            text,
            plain_http=plain_http,
            cache_size=cache_size,
            timeout=timeout,
            ranges_required=ranges_required,
            disk=disk,
        )
    transport: Transport
    if text.startswith("hf://"):
        transport, key = _hub(text, timeout)
    elif text.startswith("s3://"):
        bucket, _, path = text[len("s3://") :].partition("/")
        if not bucket:
            raise errors.SourceError(f"{text}: no bucket in the URL (s3://BUCKET/KEY)")
        transport, key = S3Transport(bucket, timeout), f"s3://{bucket}/{path}" if path else f"s3://{bucket}/"
    else:
        problem = url_problem(text)  # the command line checked it already (named_source); a caller of ours may not
        if problem is not None:
            raise errors.SourceError(f"{shown_url(text)}: not a valid URL: {problem}")
        parts = urllib.parse.urlsplit(text)
        assert parts.hostname is not None
        headers = {}
        if parts.username is not None or parts.password is not None:
            user = urllib.parse.unquote(parts.username or "")
            password = urllib.parse.unquote(parts.password or "")
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        base = f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
        # the key is the URL without its query (a presigned URL's signature: a secret, sent with every request)
        transport, key = HttpTransport(base, headers, timeout, parts.query), base + (parts.path or "/")
    source = RemoteFiles(
        transport,
        cache_size=cache_size,
        timeout=timeout,
        disk_cache=disk,
        ranges_required=ranges_required,
        prefault=ranges_required,  # a mount
    )
    return source, key


def _hub(text: str, timeout: float) -> tuple[HubTransport, str]:
    match = _HUB_REPO.match(text)
    if match is None:
        raise errors.SourceError(f"{text}: not hf://ORG/REPO[@REVISION][/PATH]")
    endpoint = endpoint_from(("HF_ENDPOINT",)) or "https://huggingface.co"  # before huggingface_hub reads it
    from huggingface_hub import HfApi

    token = os.environ.get("HF_TOKEN") or None
    repo, path = match["repo"], (match["path"] or "").strip("/")
    revision = urllib.parse.unquote(match["revision"] or "main")  # huggingface_hub encodes it again, once
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            repo, revision=revision, timeout=timeout, files_metadata=True
        )
    except Exception as exc:  # huggingface_hub's errors, and its HTTP client's (not OSError)
        raise errors.SourceError(f"hf://{repo}@{revision}: {hub_failure(exc, endpoint, token)}") from None
    files = {
        sibling.rfilename: (sibling.lfs.sha256 if sibling.lfs else sibling.blob_id) or ""
        for sibling in info.siblings or []
    }
    if not info.sha or not re.fullmatch(r"[0-9a-f]{40}", info.sha):
        raise errors.SourceError(f"hf://{repo}@{revision}: the Hub did not say which commit it is (no sha)")
    sizes = {sibling.rfilename: sibling.size for sibling in info.siblings or [] if sibling.size is not None}
    sha256s = {sibling.rfilename: sibling.lfs.sha256 for sibling in info.siblings or [] if sibling.lfs}
    modified = info.last_modified or info.created_at
    mtime_ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    transport = HubTransport(repo, info.sha, files, endpoint, token, timeout, revision, sizes, mtime_ns, sha256s)
    return transport, transport.base + (f"/{path}" if path else "/")


def hub_failure(exc: BaseException, endpoint: str, token: str | None) -> str:
    """Why the Hub did not answer as asked, in one line (never the token)."""
    name = type(exc).__name__
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if name == "GatedRepoError":
        if token:
            return "a gated repository: HF_TOKEN's account has not been granted access"
        return "a gated repository: a token of an account granted access is needed (HF_TOKEN)"
    if name == "RepositoryNotFoundError":
        if token:
            return "no such repository, or HF_TOKEN grants no access to it"
        return "no such repository, or a private or gated one: a token is needed (HF_TOKEN)"
    if name.startswith("Hf") and status in (401, 403):
        if token:
            return f"the Hub refused HF_TOKEN (HTTP {status})"
        return f"access denied (HTTP {status}): a token is needed (HF_TOKEN)"
    if name == "RevisionNotFoundError":
        return "no such revision (a branch, tag, commit or refs/pr/N)"
    if name == "DisabledRepoError":
        return "the repository is disabled"
    if name == "HFValidationError":  # a repository name or revision the Hub cannot have; no request was made
        return first_line(exc)
    if name == "OfflineModeIsEnabled":
        return "HF_HUB_OFFLINE is set: stfs reads the Hub over the network"
    if status is not None or name.startswith("Hf"):
        return first_line(exc)  # e.g. "500 Server Error: Internal Server Error for url: ..."
    return f"cannot reach {endpoint}: {describe(exc).cause}"


def endpoint_from(variables: tuple[str, ...]) -> str | None:
    """The URL the first of ``variables`` set in the environment holds (``None`` if none is), checked: a
    ``SourceError`` naming the variable if it is not an http(s) URL stfs can use (obstore panics on some)."""
    name, value = next(((name, os.environ[name]) for name in variables if os.environ.get(name)), ("", None))
    if value is None:
        return None
    if not value.startswith(("http://", "https://")) or url_problem(value) is not None:
        raise errors.SourceError(
            f"{name}={shown_url(value)}: not an http:// or https:// URL with a host and a valid port"
        )
    return value
