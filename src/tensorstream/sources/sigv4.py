"""AWS Signature Version 4 for S3 requests without a body, standard library only.

Why not botocore's signer: importing ``botocore.auth`` takes about 0.1 s, on the critical
path of every signed S3 cold start (the first object a remote model directory opens is
signed before the weights' fetch and ``import torch`` begin). The algorithm is AWS's
published one (header-based auth, "Signature Version 4"); the result equals botocore's
``S3SigV4Auth`` for our requests (tested header for header): the payload hash of an empty
body, the path as it stands in the URL (S3 does not normalise it), no query string.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlsplit

__all__ = ["sign_s3"]

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Headers a signature leaves out: hop-by-hop ones and those proxies or clients rewrite.
_UNSIGNED = frozenset(
    {
        "authorization",
        "baggage",
        "connection",
        "expect",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "traceparent",
        "tracestate",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "x-amzn-trace-id",
    }
)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign_s3(
    method: str,
    url: str,
    headers: dict[str, str],
    keys: tuple[str, str, str | None],
    region: str,
    amz_date: str | None = None,
) -> dict[str, str]:
    """``headers`` plus the signature headers for a body-less S3 request.

    Args:
        method: ``GET`` or ``HEAD``.
        url: the request URL, its path already quoted, without a query string.
        headers: the headers to send (and sign).
        keys: ``(access_key_id, secret_access_key, session_token or None)``.
        region: the signing region.
        amz_date: ``YYYYMMDDTHHMMSSZ``; now, in UTC, by default.
    """
    amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    access_key, secret, token = keys
    # the caller's signature headers are replaced (a session token only when there is one)
    replaced = {"authorization", "x-amz-date", "x-amz-content-sha256"}
    if token:
        replaced.add("x-amz-security-token")
    out = {k: v for k, v in headers.items() if k.lower() not in replaced}
    out["X-Amz-Date"] = amz_date
    if token:
        out["X-Amz-Security-Token"] = token
    out["X-Amz-Content-SHA256"] = _EMPTY_SHA256

    signed: dict[str, list[str]] = {}
    for name, value in out.items():
        if name.lower() not in _UNSIGNED:
            signed.setdefault(name.lower(), []).append(" ".join(str(value).split()))
    signed.setdefault("host", [_host(url)])
    names = sorted(signed)
    canonical = "\n".join(
        [
            method.upper(),
            urlsplit(url).path or "/",
            "",  # no query string
            "".join(f"{n}:{','.join(signed[n])}\n" for n in names),
            ";".join(names),
            _EMPTY_SHA256,
        ]
    )
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = _hmac(("AWS4" + secret).encode(), amz_date[:8])
    for part in (region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return out
