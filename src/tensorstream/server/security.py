"""Who may make the server touch what: the API key and the places runtime adapters may come from.

A client that can call ``/v1/load_lora_adapter`` names a location and the
server reads it, so without limits that endpoint fetches any URL and probes
any local file. Runtime loading is therefore off unless the operator turns it
on (``--enable-runtime-lora-updating`` or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), and even then only locations under an
allowed root are read:

* a local directory: the requested path is resolved (symlinks, ``..``) and
  must lie inside the resolved root;
* ``s3://bucket/prefix``: same bucket, key under the prefix;
* ``http(s)://host[:port]/prefix``: same scheme, host and port, path under
  the prefix. URLs with userinfo, queries, fragments, backslashes or dot
  segments (also percent-encoded) are refused outright.

Prefixes match whole path segments: ``/adapters`` allows ``/adapters/x`` but
not ``/adapters-old``.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tensorstream.errors import ConfigError

__all__ = [
    "AllowedRoots",
    "LocationRefused",
    "resolve_api_key",
    "runtime_lora_updating_enabled",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def runtime_lora_updating_enabled(flag: bool, environ: Mapping[str, str] | None = None) -> bool:
    """True when the operator allowed loading adapters over HTTP (flag or vLLM's variable)."""
    env = os.environ if environ is None else environ
    return flag or env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in _TRUE


def resolve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The API key: ``--api-key``, else ``$TENSORSTREAM_API_KEY``, else vLLM's ``$VLLM_API_KEY``.

    A deployment migrated from vLLM keeps its key in ``VLLM_API_KEY``; ignoring it
    would silently serve without authentication.
    """
    env = os.environ if environ is None else environ
    for value in (flag, env.get("TENSORSTREAM_API_KEY"), env.get("VLLM_API_KEY")):
        if value:
            return value
    return None


@dataclass(frozen=True)
class _URLRoot:
    scheme: str
    host: str  # s3: the bucket
    port: int | None
    segments: tuple[str, ...]


class LocationRefused(Exception):
    """A location outside every allowed root (or malformed); the message is safe to show."""


class AllowedRoots:
    """The places runtime adapters and their key files may be read from.

    Args:
        roots: local directories, ``s3://bucket/prefix`` and ``http(s)://host/prefix``
            URIs; each item may hold several, comma-separated.

    Raises:
        ConfigError: a root that is malformed (userinfo, query, unknown scheme).

    Example:
        >>> roots = AllowedRoots(["s3://models/adapters"])
        >>> roots.check("s3://models/adapters/a1")
        's3://models/adapters/a1'
    """

    def __init__(self, roots: Iterable[str] = ()) -> None:
        self.local: list[str] = []
        self.urls: list[_URLRoot] = []
        self.display: list[str] = []
        for item in roots:
            for raw in str(item).split(","):
                raw = raw.strip()
                if not raw:
                    continue
                self.display.append(raw)
                if "://" not in raw or raw.lower().startswith("file://"):
                    self.local.append(os.path.realpath(_local_path(raw)))
                    continue
                try:
                    self.urls.append(_parse_url(raw))
                except LocationRefused as exc:
                    raise ConfigError(f"--lora-allowed-roots {raw!r}: {exc}") from exc

    def __bool__(self) -> bool:
        return bool(self.local or self.urls)

    def check(self, location: str) -> str:
        """Return the location to read (local paths resolved) if it lies under a root.

        Raises:
            LocationRefused: it does not, or it is malformed; the message reveals only
                what the caller sent.
        """
        if "://" not in location or location.lower().startswith("file://"):
            if "\x00" in location:
                raise LocationRefused("the path contains a NUL byte")
            resolved = os.path.realpath(_local_path(location))
            for root in self.local:
                if resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep):
                    return resolved
            raise LocationRefused("it is not under an allowed root")
        wanted = _parse_url(location)
        for root in self.urls:
            if (wanted.scheme, wanted.host, wanted.port) == (
                root.scheme,
                root.host,
                root.port,
            ) and wanted.segments[: len(root.segments)] == root.segments:
                return location
        raise LocationRefused("it is not under an allowed root")


def _local_path(raw: str) -> str:
    if raw.lower().startswith("file://"):
        parts = urllib.parse.urlsplit(raw)
        if parts.netloc not in ("", "localhost"):
            raise LocationRefused("file:// URIs must name a local path")
        return urllib.parse.unquote(parts.path)
    return os.path.abspath(os.path.expanduser(raw))


def _parse_url(raw: str) -> _URLRoot:
    if any(c in raw for c in "\\\x00\r\n\t ") or any(ord(c) < 0x20 for c in raw):
        raise LocationRefused("the URI contains a backslash, space or control character")
    try:
        parts = urllib.parse.urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise LocationRefused("the URI is malformed") from exc
    scheme = parts.scheme.lower()
    if scheme not in ("s3", "http", "https"):
        raise LocationRefused(f"scheme {scheme!r} is not one of s3, http, https")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise LocationRefused("URIs with user information are not accepted")
    if parts.query or parts.fragment or "?" in raw or "#" in raw:
        raise LocationRefused("URIs with a query or fragment are not accepted")
    host = (parts.hostname or "").lower()
    if not host:
        raise LocationRefused("the URI has no host or bucket")
    if scheme == "s3":
        if port is not None:
            raise LocationRefused("s3:// URIs take a bucket, not host:port")
    else:
        port = port if port is not None else _DEFAULT_PORTS[scheme]
    segments = []
    for segment in parts.path.split("/"):
        decoded = urllib.parse.unquote(segment)
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            raise LocationRefused("the URI has dot segments or encoded separators")
        if segment:
            segments.append(decoded)
    return _URLRoot(scheme, host, port, tuple(segments))
