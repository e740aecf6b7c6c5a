"""S3 credentials, endpoint, region and addressing: where each comes from, first match wins.

Owns ``resolve_s3_credentials`` and the ``S3Credentials`` it returns. Each item
resolves on its own, in this order:

* keys: ``StorageOptions.s3_unsigned`` (anonymous); ``s3_access_key_id`` +
  ``s3_secret_access_key`` (+ ``s3_session_token``; both keys ``""`` also means
  anonymous, as in tensorizer); env ``S3_ACCESS_KEY_ID`` + ``S3_SECRET_ACCESS_KEY``
  (vLLM's names); env ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY``
  (+ ``AWS_SESSION_TOKEN``); s3cmd config ``access_key`` / ``secret_key``
  (+ ``access_token``); the standard AWS chain through botocore (profiles, SSO,
  instance roles), consulted only when nothing above matched; else anonymous.
* endpoint: ``s3_endpoint``; env ``S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT_URL``; s3cmd ``host_base`` (+ ``use_https``); AWS config
  ``s3.endpoint_url`` / ``endpoint_url``; AWS S3 for the region.
* region: ``s3_region``; env ``AWS_REGION``, ``AWS_DEFAULT_REGION``; AWS config;
  the region in an AWS endpoint's host name; ``us-east-1``.

The s3cmd config is ``StorageOptions.s3_config_path`` or ``~/.s3cfg``. An
endpoint without a scheme gets ``https://`` (``http://`` when the s3cmd config
says ``use_https = False``). Secrets never appear in ``repr``, ``str`` or
messages: ``S3Credentials.describe()`` names where they came from instead.
"""

from __future__ import annotations

import configparser
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorstream.errors import AccessDeniedError, ConfigError
from tensorstream.sources.base import StorageOptions

__all__ = ["S3Credentials", "resolve_s3_credentials"]

_DEFAULT_REGION = "us-east-1"
_AWS_HOST = re.compile(r"(^|\.)amazonaws\.com(\.cn)?$")
_AWS_REGION_IN_HOST = re.compile(r"(?:^|\.)s3[.-]([a-z0-9-]+)\.amazonaws\.com")


@dataclass(frozen=True)
class S3Credentials:
    """Resolved S3 settings; the repr shows where secrets came from, never the secrets.

    Attributes:
        access_key_id: the key id (``None`` for anonymous or chain-provided keys).
        secret_access_key: the secret key.
        session_token: an STS session token, if any.
        endpoint: ``scheme://host[:port]`` of the S3 API.
        region: signing region.
        addressing: ``"path"`` or ``"virtual"`` (for endpoints where it is not forced).
        unsigned: send anonymous requests.
        key_source: where the keys came from (for error hints).
        endpoint_source: where the endpoint came from.
        provider: botocore credentials that refresh themselves (AWS chain only).
    """

    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    endpoint: str = f"https://s3.{_DEFAULT_REGION}.amazonaws.com"
    region: str = _DEFAULT_REGION
    addressing: str = "virtual"
    unsigned: bool = False
    key_source: str = ""
    endpoint_source: str = ""
    provider: Any = field(default=None, repr=False, compare=False)

    @property
    def is_aws(self) -> bool:
        """True when the endpoint is Amazon S3 itself."""
        return bool(_AWS_HOST.search(_host(self.endpoint)))

    def keys(self) -> tuple[str, str, str | None] | None:
        """Current ``(access_key_id, secret, token)``, refreshed if the chain supplied them.

        Returns:
            ``None`` for anonymous access.
        """
        if self.unsigned:
            return None
        if self.provider is not None:
            frozen = self.provider.get_frozen_credentials()
            return frozen.access_key, frozen.secret_key, frozen.token
        if self.access_key_id is None or self.secret_access_key is None:
            return None
        return self.access_key_id, self.secret_access_key, self.session_token

    def describe(self) -> str:
        """A log-safe account of where each setting came from (no secrets)."""
        if self.unsigned:
            keys = f"unsigned requests ({self.key_source})"
        else:
            keys = f"keys from {self.key_source}"
            if self.access_key_id:
                keys += f" (key id {_mask(self.access_key_id)})"
            if self.session_token or (self.provider is not None and self.provider.token):
                keys += " with a session token"
        return (
            f"{keys}; endpoint {self.endpoint} (from {self.endpoint_source}); "
            f"region {self.region}; {self.addressing}-style addressing"
        )

    def __repr__(self) -> str:
        return f"S3Credentials({self.describe()})"

    __str__ = __repr__


def _mask(key_id: str) -> str:
    return key_id[:4] + "…" if len(key_id) > 8 else "…"


def _host(endpoint: str) -> str:
    rest = endpoint.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1].split(":", 1)[0].lower()


def _with_scheme(endpoint: str, use_https: bool = True) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if "://" in endpoint:
        scheme = endpoint.split("://", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"S3 endpoint {endpoint!r} must use http:// or https://")
        return endpoint
    return ("https://" if use_https else "http://") + endpoint


def _read_s3cfg(options: StorageOptions) -> tuple[str, dict[str, str]] | None:
    """The ``[default]`` section of the s3cmd config, or ``None`` if there is none."""
    explicit = options.s3_config_path
    path = os.path.expanduser(explicit or "~/.s3cfg")
    if not os.path.isfile(path):
        if explicit:
            raise ConfigError(f"s3_config_path {explicit!r} does not exist; give an s3cmd config")
        return None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse s3cmd config {path}: {type(exc).__name__}") from None
    if not parser.has_section("default"):
        return None
    section = {k: v.strip() for k, v in parser.items("default")}
    return path, section


def _pair(env: Mapping[str, str], id_name: str, secret_name: str) -> tuple[str, str] | None:
    key_id, secret = env.get(id_name), env.get(secret_name)
    if key_id and secret:
        return key_id, secret
    if key_id or secret:
        present, missing = (id_name, secret_name) if key_id else (secret_name, id_name)
        raise ConfigError(f"{present} is set but {missing} is not; set both or neither")
    return None


#: botocore sessions by what they read (AWS_* variables, the config files' stats).
_SESSIONS: dict[tuple[Any, ...], Any] = {}
#: botocore sessions are not thread-safe: one lock around making and consulting them.
_SESSIONS_LOCK = threading.RLock()


def _aws_files() -> list[str]:
    """The AWS config and shared-credentials files botocore would read."""
    return [
        os.path.expanduser(os.environ.get(name) or default)
        for name, default in (
            ("AWS_CONFIG_FILE", "~/.aws/config"),
            ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        )
    ]


def _session_key() -> tuple[Any, ...]:
    """What a botocore session is made from: a change to any of it makes a new one."""
    aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    files = []
    for path in _aws_files():
        try:
            stat = os.stat(path)
            files.append((path, stat.st_mtime_ns, stat.st_size))
        except OSError:
            files.append((path, None, None))
    return aws, tuple(files)


class _Botocore:
    """The process's botocore session for the current AWS settings, made on first use.

    Making one registers botocore's ~500 event handlers, about 12 ms of CPU: paid once
    per process, not once per object opened (a remote model directory opens ~15).
    """

    def __init__(self) -> None:
        self._session: Any = None

    def session(self) -> Any:
        if self._session is None:
            key = _session_key()
            with _SESSIONS_LOCK:
                if key not in _SESSIONS:
                    import botocore.session

                    if len(_SESSIONS) >= 8:  # settings changed over and over: keep it small
                        _SESSIONS.clear()
                    _SESSIONS[key] = botocore.session.Session()
                self._session = _SESSIONS[key]
        return self._session

    def credentials(self) -> Any:
        session = self.session()
        with _SESSIONS_LOCK:
            return session.get_credentials()

    def scoped(self, name: str) -> str | None:
        if not any(os.path.exists(path) for path in _aws_files()):
            return None  # a profile's settings live only there: no botocore to import
        try:
            session = self.session()
            with _SESSIONS_LOCK:
                config = session.get_scoped_config()
        except Exception:  # a broken or missing profile must not hide other sources
            return None
        s3 = config.get("s3")
        if name == "endpoint_url" and isinstance(s3, dict) and s3.get("endpoint_url"):
            return str(s3["endpoint_url"])
        value = config.get(name)
        return str(value) if value else None


def resolve_s3_credentials(
    options: StorageOptions | None = None, env: Mapping[str, str] | None = None
) -> S3Credentials:
    """Find S3 keys, endpoint, region and addressing style (see the module docstring).

    Args:
        options: explicit settings; they win over everything else.
        env: environment to read (default ``os.environ``).

    Returns:
        The resolved settings; ``unsigned`` when no keys were found anywhere.

    Raises:
        ConfigError: half a key pair, a missing explicit s3cmd config, a bad
            endpoint scheme or addressing style.
        AccessDeniedError: the AWS default chain was consulted and failed.

    Example:
        >>> creds = resolve_s3_credentials(StorageOptions(s3_endpoint="http://127.0.0.1:8333",
        ...     s3_access_key_id="id", s3_secret_access_key="secret"))
        >>> creds.addressing, creds.region
        ('path', 'us-east-1')
    """
    opts = options or StorageOptions()
    env = os.environ if env is None else env
    boto = _Botocore()
    s3cfg = _read_s3cfg(opts)
    cfg_path, cfg = s3cfg if s3cfg else ("", {})

    # -- keys
    key_id = secret = token = None
    provider = None
    unsigned = False
    if opts.s3_unsigned:
        unsigned, key_source = True, "StorageOptions.s3_unsigned"
    elif opts.s3_access_key_id is not None or opts.s3_secret_access_key is not None:
        if opts.s3_access_key_id == "" and opts.s3_secret_access_key == "":
            unsigned, key_source = True, "empty keys in StorageOptions"
        elif not (opts.s3_access_key_id and opts.s3_secret_access_key):
            raise ConfigError(
                "StorageOptions has only one of s3_access_key_id / s3_secret_access_key; "
                "give both (or s3_unsigned=True for a public bucket)"
            )
        else:
            key_id, secret = opts.s3_access_key_id, opts.s3_secret_access_key
            token, key_source = opts.s3_session_token, "StorageOptions"
    elif pair := _pair(env, "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY"):
        (key_id, secret), token = pair, opts.s3_session_token
        key_source = "env S3_ACCESS_KEY_ID/S3_SECRET_ACCESS_KEY"
    elif pair := _pair(env, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        (key_id, secret) = pair
        token = opts.s3_session_token or env.get("AWS_SESSION_TOKEN") or None
        key_source = "env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    elif cfg.get("access_key") and cfg.get("secret_key"):
        key_id, secret = cfg["access_key"], cfg["secret_key"]
        token = opts.s3_session_token or cfg.get("access_token") or None
        key_source = f"s3cmd config {cfg_path}"
    else:
        try:
            chain = boto.credentials()
        except Exception as exc:  # botocore raises many types; a configured provider failed
            raise AccessDeniedError(
                f"the AWS default credential chain failed ({type(exc).__name__}); give keys "
                "in StorageOptions or S3_ACCESS_KEY_ID/S3_SECRET_ACCESS_KEY, or set "
                "s3_unsigned=True for a public bucket"
            ) from exc
        if chain is None:
            unsigned, key_source = True, "no credentials found in options, env, s3cmd or AWS config"
        else:
            provider = chain
            key_source = f"the AWS default chain ({getattr(chain, 'method', 'unknown')})"

    # -- endpoint
    endpoint = None
    if opts.s3_endpoint:
        endpoint, endpoint_source = _with_scheme(opts.s3_endpoint), "StorageOptions"
    else:
        for name in ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if env.get(name):
                endpoint, endpoint_source = _with_scheme(env[name]), f"env {name}"
                break
    if endpoint is None and cfg.get("host_base"):
        use_https = cfg.get("use_https", "True").strip().lower() not in ("false", "no", "0", "off")
        endpoint = _with_scheme(cfg["host_base"], use_https)
        endpoint_source = f"s3cmd config {cfg_path}"
    if endpoint is None and (configured := boto.scoped("endpoint_url")):
        endpoint, endpoint_source = _with_scheme(configured), "AWS config endpoint_url"

    # -- region
    region = opts.s3_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region:
        region = boto.scoped("region")
    if not region and endpoint and (m := _AWS_REGION_IN_HOST.search(_host(endpoint))):
        region = m.group(1)
    region = region or _DEFAULT_REGION
    if endpoint is None:
        endpoint, endpoint_source = f"https://s3.{region}.amazonaws.com", "AWS default for region"

    # -- addressing
    style = opts.s3_addressing
    if style not in ("auto", "path", "virtual"):
        raise ConfigError(f"s3_addressing must be 'auto', 'path' or 'virtual', got {style!r}")
    if style == "auto":
        style = "virtual" if _AWS_HOST.search(_host(endpoint)) else "path"

    return S3Credentials(
        access_key_id=key_id,
        secret_access_key=secret,
        session_token=token,
        endpoint=endpoint,
        region=region,
        addressing=style,
        unsigned=unsigned,
        key_source=key_source,
        endpoint_source=endpoint_source,
        provider=provider,
    )
