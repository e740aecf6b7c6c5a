"""Our S3 request signer (sources/sigv4.py) against botocore's S3SigV4Auth, header for
header, and the S3 path that no longer imports botocore."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tensorstream.sources.sigv4 import sign_s3


@pytest.mark.parametrize(
    ("url", "headers", "keys", "region"),
    [
        (
            "http://127.0.0.1:8333/bench/m/model.tensors",
            {"Accept-Encoding": "identity", "Range": "bytes=0-99"},
            ("AKID", "secret", None),
            "us-east-1",
        ),
        (  # quoted unicode and spaces, a session token, headers left out or trimmed
            "https://bucket.s3.eu-west-3.amazonaws.com/a%20b/%C3%A9t%C3%A9~x.tensors",
            {"If-Match": '"abc"', "User-Agent": "x", "X-Custom": "  a   b ", "Connection": "c"},
            ("AKID2", "S/E+C=", "token=="),
            "eu-west-3",
        ),
        ("https://s3.amazonaws.com:443/b/k", {}, ("AKID", "s", None), "us-east-1"),  # port
        ("http://[::1]:9000/b/k", {"Range": "bytes=5-"}, ("AKID", "s", "t"), "us-east-1"),
        (  # stale signature headers are replaced, not signed again
            "http://127.0.0.1:8333/b/k",
            {"Authorization": "old", "X-Amz-Date": "19990101T000000Z"},
            ("AKID", "s", None),
            "us-east-1",
        ),
    ],
)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_signature_equals_botocores(url, headers, keys, region, method) -> None:
    request = AWSRequest(method=method, url=url, headers=dict(headers))
    S3SigV4Auth(Credentials(*keys), "s3", region).add_auth(request)
    theirs = dict(request.headers.items())
    assert sign_s3(method, url, headers, keys, region, theirs["X-Amz-Date"]) == theirs
    assert headers.get("Authorization") in (None, "old")  # the caller's dict is untouched


def test_keys_from_the_environment_import_no_botocore() -> None:
    """Resolving keys and endpoint from the environment and signing a request leave
    botocore unimported (about 0.1 s of a cold start from S3)."""
    code = (
        "import sys\n"
        "from tensorstream.sources.credentials import resolve_s3_credentials\n"
        "from tensorstream.sources.sigv4 import sign_s3\n"
        "c = resolve_s3_credentials()\n"
        "sign_s3('GET', c.endpoint + '/b/k', {}, c.keys(), c.region)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('botocore', 'boto3'))))\n"
    )
    env = {
        **os.environ,
        "S3_ACCESS_KEY_ID": "id",
        "S3_SECRET_ACCESS_KEY": "secret",
        "S3_ENDPOINT_URL": "http://127.0.0.1:1",
        "HOME": "/nonexistent-home",
        "AWS_CONFIG_FILE": "/nonexistent/config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
