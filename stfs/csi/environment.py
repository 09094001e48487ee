"""The environment a volume's ``stfs mount`` and daemon run in (SPEC §15a): the plugin's configuration, none of its
credentials, the volume's own secret, and a home folder of the volume's own, so that a volume without a secret is
anonymous whatever the plugin's environment, home folder or cloud instance hold.

Kept is what configures where and how to connect (endpoints, region, proxies, CA bundles, locale, Python's and
stfs's own settings); everything else is left out, credentials first among them: ``AWS_*`` keys, profiles and
files, ``HF_TOKEN`` and ``HF_HOME`` (its token file), ``DOCKER_CONFIG``, ``REGISTRY_AUTH_FILE``,
``XDG_RUNTIME_DIR`` (podman's auth.json), ``HOME``. Cloud instance metadata is switched off: S3 requests go unsigned
unless the secret holds a key pair (obstore then never asks the instance for a role), and huggingface_hub sends no
token but the one given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..sources.local import ROOTS_VARIABLE

# Configuration, not credentials: names kept as they are in the plugin's environment
KEPT = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "HF_ENDPOINT",
        "HF_HUB_DISABLE_TELEMETRY",
        "HF_HUB_DISABLE_XET",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ALLOW_HTTP",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
        "AWS_SKIP_SIGNATURE",
        "AWS_CA_BUNDLE",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        "FUSE_LIBRARY_PATH",
        "FUSE_LIBRARY_NAME",
    }
)
KEPT_PREFIXES = ("LC_", "PYTHON", "STFS_")  # locale, the interpreter's own settings, stfs's
# Switched on for every volume without the plugin's credentials: no instance metadata, no implicit Hub token
ANONYMOUS = {"AWS_EC2_METADATA_DISABLED": "true", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def kept(name: str) -> bool:
    """Whether the plugin's variable ``name`` is configuration that reaches every volume."""
    return name in KEPT or name.startswith(KEPT_PREFIXES)


def for_volume(
    plugin: Mapping[str, str],
    secrets: Mapping[str, str],
    home: str,
    node_credentials: bool = False,
    roots: tuple[str, ...] = (),
) -> dict[str, str]:
    """The environment of a volume's ``stfs mount``: with ``node_credentials``, the plugin's own plus the secret;
    else the plugin's configuration, the secret, ``HOME`` the volume's own (empty) folder, instance metadata off,
    and S3 unsigned unless the secret holds a key pair. ``roots``: the folders a local source's files must resolve
    into (``--allow-path``)."""
    confined = {ROOTS_VARIABLE: os.pathsep.join(roots)} if roots else {}
    if node_credentials:
        return {**{k: v for k, v in plugin.items() if k != ROOTS_VARIABLE}, **secrets, **confined}
    environment = {name: value for name, value in plugin.items() if kept(name) and name != ROOTS_VARIABLE}
    environment.update(confined)
    environment.update(ANONYMOUS)
    environment.update(secrets)
    environment["HOME"] = home
    if not all(secrets.get(key) for key in S3_KEYS):
        environment["AWS_SKIP_SIGNATURE"] = "true"  # obstore then asks for no credentials: no instance role
    return environment
