"""Which SOURCEs a pod creator may name (SPEC §15a): shell patterns for URLs (``--allow-source``), folders on the
node for paths (``--allow-path``). No I/O beyond resolving a path's symbolic links: a SOURCE is allowed or refused
before anything of it is read, fetched or mounted.

A URL is matched by its scheme (``docker://`` is ``oci://``, as stfs reads it), then the whole of it against each
pattern, as ``fnmatch`` does; and its host part (up to the first ``/``) also against the pattern's, so that a ``*``
cannot reach across a ``/`` into the host (``https://*.example.com/*`` does not allow
``https://evil.test/.example.com/x``). Plain ``http://`` only where a pattern begins with it.

Anything that is not ``SCHEME://`` is a path on the node: absolute, at or below an allowed folder once ``..`` and
symbolic links are resolved, however stfs may read it (``PATH:REF`` and ``oci:PATH[:REF]`` name a store at PATH).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from ..errors import StfsError
from ..options import size_bytes
from ..sources.base import shown_url
from ..sources.local import inside
from .volumes import Refused

DEFAULT_SOURCES = ("hf://*", "s3://*", "oci://*", "https://*")
DEFAULT_MAX_CACHE_SIZE = "1G"
SCHEMES = ("hf", "s3", "oci", "https", "http")  # the URLs stfs reads (docker:// is oci://)
ALIASES = {"docker": "oci"}  # skopeo's and podman's spelling of a registry reference
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HOST_END = re.compile(r"[/?#\\]")  # where a URL parser ends the host part (a backslash too, as browsers and reqwest)


def denied(message: str) -> Refused:
    return Refused(grpc.StatusCode.PERMISSION_DENIED, message)


@dataclass(frozen=True, slots=True)
class Policy:
    """The operator's rules: URL patterns (``--allow-source``), folders on the node (``--allow-path``, resolved), the
    most a volume's ``cacheSize`` may be (``--max-cache-size``), and whether volumes use the plugin's own
    credentials (``--node-credentials``)."""

    sources: tuple[str, ...] = DEFAULT_SOURCES
    paths: tuple[str, ...] = ()
    max_cache_size: str = DEFAULT_MAX_CACHE_SIZE
    node_credentials: bool = False

    @classmethod
    def of(
        cls,
        sources: Sequence[str] | None,
        paths: Sequence[str] | None,
        max_cache_size: str = DEFAULT_MAX_CACHE_SIZE,
        node_credentials: bool = False,
    ) -> Policy:
        """The policy of ``stfs csi``'s flags (``sources`` None: the defaults); a ``StfsError`` naming a pattern that
        starts with no scheme stfs reads, a folder that is not an absolute path, or a size that is none."""
        for pattern in sources or ():
            match = _SCHEME.match(pattern)
            scheme = match[1].lower() if match else None
            if pattern.startswith("/") or (scheme is not None and ALIASES.get(scheme, scheme) not in SCHEMES):
                raise StfsError(
                    f"--allow-source {pattern!r}: a pattern matches URLs of {', '.join(s + '://' for s in SCHEMES)}, "
                    "best begun with its scheme; paths on the node are allowed with --allow-path"
                )
        folders = []
        for path in paths or ():
            if not os.path.isabs(path):
                raise StfsError(f"--allow-path {path!r}: not an absolute path")
            folders.append(os.path.realpath(path))
        try:
            size_bytes(max_cache_size)
        except ValueError as exc:
            raise StfsError(f"--max-cache-size {max_cache_size!r}: {exc}") from None
        chosen = DEFAULT_SOURCES if sources is None else tuple(_spelled(pattern) for pattern in sources)
        return cls(chosen, tuple(dict.fromkeys(folders)), max_cache_size, node_credentials)

    @property
    def cache_cap(self) -> int:
        return size_bytes(self.max_cache_size)

    def check_cache(self, cache_size: str | None) -> None:
        """``Refused`` INVALID_ARGUMENT, naming the cap, for a ``cacheSize`` above ``--max-cache-size``."""
        if cache_size is not None and size_bytes(cache_size) > self.cache_cap:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cacheSize {cache_size} is more than this plugin's --max-cache-size {self.max_cache_size}",
            )

    def check(self, source: str) -> None:
        """Return if SOURCE is allowed; else ``Refused`` PERMISSION_DENIED in one line naming the flag that would
        allow it."""
        match = _SCHEME.match(source)
        if match is None:
            self._check_path(source)
            return
        scheme = match[1].lower()
        url = _spelled(source)
        shown = shown_url(url)
        if scheme == "file":
            raise denied(f"{shown}: a path on the node is given as /PATH, allowed at or below an --allow-path folder")
        if ALIASES.get(scheme, scheme) not in SCHEMES:
            raise denied(f"{shown}: {scheme}:// is not a source --allow-source can allow ({', '.join(SCHEMES)})")
        spellings = [url] + ([f"{ALIASES[scheme]}://{url[len(scheme) + 3 :]}"] if scheme in ALIASES else [])
        if any(_matches(spelling, pattern) for spelling in spellings for pattern in self.sources):
            return
        raise denied(
            f"{shown}: not allowed by the plugin's --allow-source patterns ({', '.join(self.sources)}); an "
            "--allow-source pattern matching it would allow it"
        )

    def _check_path(self, source: str) -> None:
        path = source.removeprefix("oci:")
        if not os.path.isabs(path):
            raise denied(f"{source}: a path on the node must be absolute, at or below an --allow-path folder")
        # every way stfs may read it: the path itself, and PATH of each PATH:REF it spells (a store's manifest by
        # its name)
        start = len(path) - len(os.path.basename(path))
        places = [path] + [path[:at] for at in range(start, len(path)) if path[at] == ":"]
        for place in places:
            try:
                resolved = os.path.realpath(place)
            except ValueError:  # a NUL in it: no such path
                resolved = None
            if resolved is None or not inside(resolved, self.paths):
                allowed = ", ".join(self.paths) if self.paths else "none"
                raise denied(
                    f"{source}: a path on the node outside the plugin's --allow-path folders ({allowed}); an "
                    "--allow-path folder holding it would allow it"
                )


def _spelled(url: str) -> str:
    """A URL (or pattern) with its scheme in lower case, as stfs reads it."""
    match = _SCHEME.match(url)
    return url if match is None else match[1].lower() + url[len(match[1]) :]


def _matches(url: str, pattern: str) -> bool:
    """``pattern`` matches all of ``url``, and its host part matches ``url``'s alone (a ``*`` cannot span ``/``
    there). A pattern without a scheme (``*``) never matches plain ``http://``: only a pattern naming it does."""
    if not fnmatch.fnmatchcase(url, pattern):
        return False
    if "://" not in pattern:
        return not url.startswith("http://")
    url_host = _host_part(url)
    pattern_host = pattern[pattern.index("://") + 3 :].partition("/")[0]
    return fnmatch.fnmatchcase(url_host, pattern_host)


def _host_part(url: str) -> str:
    rest = url[url.index("://") + 3 :]
    end = _HOST_END.search(rest)
    return rest if end is None else rest[: end.start()]
