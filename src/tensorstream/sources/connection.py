"""HTTP connection pools for remote sources: TLS verification, CA bundles, log hygiene.

Owns ``make_pool`` (a ``urllib3.PoolManager`` with the TLS settings of
``StorageOptions``: system CAs by default, ``ca_bundle`` file or directory,
``verify_tls=False`` as an explicit opt-in warned about once per process) and
the rule that URLs in urllib3's own log records and in exception texts lose
their query strings, where presigned signatures live.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings

import urllib3

from tensorstream.errors import ConfigError
from tensorstream.sources.base import StorageOptions

__all__ = ["ca_bundle_kind", "clean_error", "make_pool"]

_POOL_SIZE = 16

_insecure_warned = False
_insecure_lock = threading.Lock()


def _warn_insecure(display_uri: str) -> None:
    global _insecure_warned
    with _insecure_lock:
        if _insecure_warned:
            return
        _insecure_warned = True
    warnings.warn(
        f"TLS certificate verification is disabled (verify_tls=False) for {display_uri} "
        "and every later HTTPS source; anyone on the network path can alter the weights",
        stacklevel=4,
    )
    # One warning from us replaces urllib3's warning on every request.
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)


def ca_bundle_kind(options: StorageOptions, *, https: bool) -> str | None:
    """``"file"`` or ``"dir"`` for the ``ca_bundle`` an HTTPS endpoint uses, else ``None``.

    A plain ``http://`` endpoint never uses a CA bundle, so a missing one is not an
    error there (a shared ``StorageOptions`` may name a bundle only HTTPS hosts need).

    Raises:
        ConfigError: ``https`` and ``ca_bundle`` names neither a file nor a directory.
    """
    if not https or not options.verify_tls or not options.ca_bundle:
        return None
    if os.path.isdir(options.ca_bundle):
        return "dir"
    if os.path.isfile(options.ca_bundle):
        return "file"
    raise ConfigError(
        f"ca_bundle {options.ca_bundle!r} is neither a file nor a directory; "
        "give a PEM bundle or a hashed certificate directory"
    )


def make_pool(
    options: StorageOptions,
    display_uri: str,
    maxsize: int = _POOL_SIZE,
    *,
    https: bool = True,
) -> urllib3.PoolManager:
    """A connection pool with the TLS settings of ``options``.

    Args:
        options: ``ca_bundle`` (file or directory) and ``verify_tls`` are honoured.
        display_uri: redacted location, for messages.
        maxsize: connections kept per host (enough for every concurrent reader).
        https: whether the endpoint is HTTPS; TLS settings are ignored for ``http://``.

    Returns:
        A ``urllib3.PoolManager``; system CAs are used unless ``ca_bundle`` is set.

    Raises:
        ConfigError: an HTTPS endpoint and a ``ca_bundle`` that does not exist.
    """
    kwargs: dict[str, object] = {"num_pools": 4, "maxsize": maxsize, "block": False}
    if not options.verify_tls:
        if https:
            _warn_insecure(display_uri)
        kwargs["cert_reqs"] = "CERT_NONE"
    kind = ca_bundle_kind(options, https=https)
    if kind == "dir":
        kwargs["ca_cert_dir"] = options.ca_bundle
    elif kind == "file":
        kwargs["ca_certs"] = options.ca_bundle
    return urllib3.PoolManager(**kwargs)  # type: ignore[arg-type]


class _RedactQueries(logging.Filter):
    """urllib3 logs request paths at DEBUG; strip their query strings (signatures)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                a.split("?", 1)[0] + "?<redacted>" if isinstance(a, str) and "?" in a else a
                for a in record.args
            )
        return True


for _name in ("urllib3.connectionpool", "urllib3.poolmanager"):
    logging.getLogger(_name).addFilter(_RedactQueries())


def clean_error(exc: BaseException | object) -> str:
    """An exception's text without query strings (urllib3 puts full URLs in messages)."""
    return re.sub(r"\?[^\s'\")]*", "?<redacted>", str(exc))
