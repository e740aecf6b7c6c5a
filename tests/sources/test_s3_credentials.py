"""Precedence of S3 credential, endpoint and region sources, one step at a time.

HOME points at an empty temp dir and the AWS config files at temp paths, so
neither ~/.s3cfg nor ~/.aws of the machine can leak in.
"""

from __future__ import annotations

import pytest

from tensorstream.errors import ConfigError
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.credentials import S3Credentials, resolve_s3_credentials

_ENV = (
    "S3_ACCESS_KEY_ID",
    "S3_SECRET_ACCESS_KEY",
    "S3_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Container-role endpoints would be part of the chain; keep the test machine's out.
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    return home


def _s3cfg(home, body: str) -> None:
    (home / ".s3cfg").write_text("[default]\n" + body)


def _all_sources(monkeypatch, home) -> None:
    monkeypatch.setenv("S3_ACCESS_KEY_ID", "s3-env-id")
    monkeypatch.setenv("S3_SECRET_ACCESS_KEY", "s3-env-secret")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aws-env-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-env-secret")
    _s3cfg(home, "access_key = cfg-id\nsecret_key = cfg-secret\nhost_base = cfg.example:9000\n")
    (home / "aws-credentials").write_text(
        "[default]\naws_access_key_id = chain-id\naws_secret_access_key = chain-secret\n"
    )


def test_options_win(monkeypatch, clean_env) -> None:
    _all_sources(monkeypatch, clean_env)
    creds = resolve_s3_credentials(
        StorageOptions(
            s3_access_key_id="opt-id", s3_secret_access_key="opt-secret", s3_session_token="tok"
        )
    )
    assert creds.keys() == ("opt-id", "opt-secret", "tok")
    assert creds.key_source == "StorageOptions"


def test_vllm_env_names_next(monkeypatch, clean_env) -> None:
    _all_sources(monkeypatch, clean_env)
    creds = resolve_s3_credentials(StorageOptions())
    assert creds.keys() == ("s3-env-id", "s3-env-secret", None)
    assert "S3_ACCESS_KEY_ID" in creds.key_source


def test_aws_env_with_session_token(monkeypatch, clean_env) -> None:
    _all_sources(monkeypatch, clean_env)
    monkeypatch.delenv("S3_ACCESS_KEY_ID")
    monkeypatch.delenv("S3_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "sts-token")
    creds = resolve_s3_credentials()
    assert creds.keys() == ("aws-env-id", "aws-env-secret", "sts-token")
    assert "session token" in creds.describe()
    assert "sts-token" not in repr(creds)


def test_s3cfg_then(monkeypatch, clean_env) -> None:
    _all_sources(monkeypatch, clean_env)
    for name in (
        "S3_ACCESS_KEY_ID",
        "S3_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ):
        monkeypatch.delenv(name)
    creds = resolve_s3_credentials()
    assert creds.keys() == ("cfg-id", "cfg-secret", None)
    assert creds.key_source.startswith("s3cmd config")
    assert creds.endpoint == "https://cfg.example:9000"
    assert creds.addressing == "path"


def test_explicit_s3cfg_path_and_use_https_false(tmp_path) -> None:
    cfg = tmp_path / "my.s3cfg"
    cfg.write_text(
        "[default]\naccess_key = a\nsecret_key = b\nhost_base = minio.local\nuse_https = False\n"
    )
    creds = resolve_s3_credentials(StorageOptions(s3_config_path=str(cfg)))
    assert creds.endpoint == "http://minio.local"
    assert creds.keys() == ("a", "b", None)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_s3_credentials(StorageOptions(s3_config_path=str(tmp_path / "missing")))


def test_aws_chain_last(clean_env) -> None:
    (clean_env / "aws-credentials").write_text(
        "[default]\naws_access_key_id = chain-id\naws_secret_access_key = chain-secret\n"
    )
    (clean_env / "aws-config").write_text("[default]\nregion = eu-west-3\n")
    creds = resolve_s3_credentials()
    assert creds.keys() == ("chain-id", "chain-secret", None)
    assert "AWS default chain" in creds.key_source
    assert creds.region == "eu-west-3"
    assert creds.endpoint == "https://s3.eu-west-3.amazonaws.com"
    assert creds.addressing == "virtual"
    assert "chain-secret" not in repr(creds)


def test_nothing_found_is_unsigned(clean_env) -> None:
    creds = resolve_s3_credentials()
    assert creds.unsigned and creds.keys() is None
    assert "no credentials" in creds.describe()


def test_unsigned_option_and_empty_keys(monkeypatch) -> None:
    monkeypatch.setenv("S3_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("S3_SECRET_ACCESS_KEY", "secret")
    assert resolve_s3_credentials(StorageOptions(s3_unsigned=True)).keys() is None
    empty = StorageOptions(s3_access_key_id="", s3_secret_access_key="")
    assert resolve_s3_credentials(empty).unsigned


def test_half_a_key_pair_is_an_error(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="s3_secret_access_key"):
        resolve_s3_credentials(StorageOptions(s3_access_key_id="only-id"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "only-id")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        resolve_s3_credentials()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"S3_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "http://b:2"}, "http://a:1"),
        ({"AWS_ENDPOINT_URL_S3": "http://b:2", "AWS_ENDPOINT_URL": "http://c:3"}, "http://b:2"),
        ({"AWS_ENDPOINT_URL": "c.example:3"}, "https://c.example:3"),
    ],
)
def test_endpoint_precedence(monkeypatch, clean_env, env, expected) -> None:
    _s3cfg(clean_env, "host_base = cfg.example\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve_s3_credentials(StorageOptions(s3_unsigned=True)).endpoint == expected
    explicit = StorageOptions(s3_unsigned=True, s3_endpoint="http://opt:9/")
    assert resolve_s3_credentials(explicit).endpoint == "http://opt:9"


def test_region_precedence(monkeypatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert resolve_s3_credentials(StorageOptions(s3_unsigned=True)).region == "ap-south-1"
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    assert resolve_s3_credentials(StorageOptions(s3_unsigned=True)).region == "eu-central-1"
    opts = StorageOptions(s3_unsigned=True, s3_region="us-west-2")
    assert resolve_s3_credentials(opts).region == "us-west-2"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    aws = StorageOptions(s3_unsigned=True, s3_endpoint="https://s3.sa-east-1.amazonaws.com")
    assert resolve_s3_credentials(aws).region == "sa-east-1"
    assert resolve_s3_credentials(StorageOptions(s3_unsigned=True)).region == "us-east-1"


def test_addressing(monkeypatch) -> None:
    custom = StorageOptions(s3_unsigned=True, s3_endpoint="http://127.0.0.1:8333")
    assert resolve_s3_credentials(custom).addressing == "path"
    aws = StorageOptions(s3_unsigned=True)
    assert resolve_s3_credentials(aws).addressing == "virtual"
    forced = StorageOptions(s3_unsigned=True, s3_endpoint="http://h:1", s3_addressing="virtual")
    assert resolve_s3_credentials(forced).addressing == "virtual"
    with pytest.raises(ConfigError, match="s3_addressing"):
        resolve_s3_credentials(StorageOptions(s3_unsigned=True, s3_addressing="dns"))
    with pytest.raises(ConfigError, match="http"):
        resolve_s3_credentials(StorageOptions(s3_unsigned=True, s3_endpoint="ftp://h"))


def test_repr_hides_secrets() -> None:
    creds = resolve_s3_credentials(
        StorageOptions(
            s3_access_key_id="AKIAEXAMPLEKEYID0001",
            s3_secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            s3_session_token="FwoGZXIvYXdzEXAMPLETOKEN",
            s3_endpoint="http://127.0.0.1:1",
        )
    )
    for text in (repr(creds), str(creds), creds.describe(), repr(StorageOptions())):
        assert "wJalrXUtnFEMI" not in text and "FwoGZXIv" not in text
        assert "EXAMPLEKEYID0001" not in text
    assert isinstance(creds, S3Credentials)


def test_failing_aws_chain_is_access_denied(monkeypatch) -> None:
    from tensorstream.errors import AccessDeniedError

    # A container-credentials endpoint that refuses connections: the chain raises.
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:9/creds")
    monkeypatch.setenv("AWS_METADATA_SERVICE_NUM_ATTEMPTS", "1")
    with pytest.raises(AccessDeniedError, match="default credential chain"):
        resolve_s3_credentials()


def test_one_botocore_session_per_settings(monkeypatch, clean_env) -> None:
    """A botocore session (~12 ms to make) is made once for the same AWS settings and
    again when they change: an AWS_* variable, or the config file rewritten."""
    import os

    from tensorstream.sources import credentials

    monkeypatch.setattr(credentials, "_SESSIONS", {})
    config = clean_env / "aws-config"
    config.write_text("[default]\nregion = eu-west-3\n")
    assert resolve_s3_credentials().region == "eu-west-3"
    assert resolve_s3_credentials().region == "eu-west-3"
    assert len(credentials._SESSIONS) == 1  # the second resolve reused the session

    monkeypatch.setenv("AWS_PROFILE", "other")
    config.write_text("[default]\nregion = eu-west-3\n[profile other]\nregion = ap-south-1\n")
    assert resolve_s3_credentials().region == "ap-south-1"
    assert len(credentials._SESSIONS) == 2

    config.write_text("[default]\nregion = eu-west-3\n[profile other]\nregion = sa-east-1\n")
    stat = config.stat()  # a rewrite within the clock's resolution still changes the size
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert resolve_s3_credentials().region == "sa-east-1"
    assert len(credentials._SESSIONS) == 3
