"""The server's location policy and switches, on real directories and symlinks (no server)."""

from __future__ import annotations

import os

import pytest

from tensorstream.errors import ConfigError
from tensorstream.server.security import (
    AllowedRoots,
    LocationRefused,
    resolve_api_key,
    runtime_lora_updating_enabled,
)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "adapter").mkdir(parents=True)
    (tmp_path / "root-evil").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    os.symlink(root / "adapter", root / "alias")
    return tmp_path, root


def test_local_paths_stay_inside_the_resolved_root(tree):
    base, root = tree
    roots = AllowedRoots([str(root)])
    assert roots.check(str(root / "adapter")) == str((root / "adapter").resolve())
    assert roots.check(str(root / "alias")) == str((root / "adapter").resolve())
    assert roots.check(f"file://{root}/adapter") == str((root / "adapter").resolve())
    for refused in (
        str(root / "escape"),  # symlink out of the root
        str(root / "adapter" / ".." / ".." / "outside"),
        str(base / "root-evil"),  # shares the root's name as a string prefix
        "/etc/passwd",
        "adapter",  # relative: resolved against the server's cwd, not the root
        f"{root}/adapter\x00",
    ):
        with pytest.raises(LocationRefused):
            roots.check(refused)


def test_root_that_is_a_symlink_is_resolved(tree):
    base, root = tree
    link = base / "link-to-root"
    os.symlink(root, link)
    roots = AllowedRoots([str(link)])
    assert roots.check(str(root / "adapter")) == str((root / "adapter").resolve())


@pytest.mark.parametrize(
    "location",
    [
        "https://models.example.com/adapters/a1",
        "https://MODELS.example.com:443/adapters/a1/",
        "https://models.example.com/adapters",
        "s3://bucket/prefix/x",
        "s3://bucket/prefix",
    ],
)
def test_url_prefixes_allow(location):
    roots = AllowedRoots(["https://models.example.com/adapters,s3://bucket/prefix"])
    assert roots.check(location) == location


@pytest.mark.parametrize(
    "location",
    [
        "http://models.example.com/adapters/a1",  # scheme differs
        "https://models.example.com:8443/adapters/a1",  # port differs
        "https://models.example.com/adapters-old/a1",  # not a whole segment
        "https://models.example.com/adapters/../secrets",
        "https://models.example.com/adapters/%2e%2e/secrets",
        "https://models.example.com/adapters/a%2fb",
        "https://models.example.com@evil.example.net/adapters/a1",  # userinfo trick
        "https://user:pw@models.example.com/adapters/a1",
        "https://evil.example.net/models.example.com/adapters/a1",
        "https://models.example.com/adapters/a1?x=1",
        "https://models.example.com/adapters/a1#frag",
        "https://models.example.com\\@evil.example.net/adapters",
        "s3://bucket/prefixed/x",
        "s3://other-bucket/prefix/x",
        "s3://bucket/other/x",
        "gs://bucket/prefix/x",
        "ftp://models.example.com/adapters/a1",
        "/etc",
    ],
)
def test_url_prefixes_refuse(location):
    roots = AllowedRoots(["https://models.example.com/adapters", "s3://bucket/prefix"])
    with pytest.raises(LocationRefused):
        roots.check(location)


def test_no_roots_allow_nothing(tmp_path):
    roots = AllowedRoots([])
    assert not roots
    with pytest.raises(LocationRefused):
        roots.check(str(tmp_path))


@pytest.mark.parametrize("root", ["https://user@host/x", "gs://b/x", "https://host/x?y=1"])
def test_malformed_roots_are_config_errors(root):
    with pytest.raises(ConfigError, match="--lora-allowed-roots"):
        AllowedRoots([root])


def test_switches_read_vllm_variables():
    assert runtime_lora_updating_enabled(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_lora_updating_enabled(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_lora_updating_enabled(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_lora_updating_enabled(False, {})
    assert runtime_lora_updating_enabled(True, {})
    assert resolve_api_key(None, {"VLLM_API_KEY": "v"}) == "v"
    assert resolve_api_key(None, {"VLLM_API_KEY": "v", "TENSORSTREAM_API_KEY": "t"}) == "t"
    assert resolve_api_key("flag", {"VLLM_API_KEY": "v"}) == "flag"
    assert resolve_api_key(None, {}) is None


def test_metrics_registries_are_per_app():
    from prometheus_client.parser import text_string_to_metric_families

    from tensorstream.server.metrics import ServerMetrics

    first, second = ServerMetrics("a"), ServerMetrics("b")  # no duplicate-series error
    first.prompt_tokens.inc(5)
    first.finished("stop")

    def samples(metrics: ServerMetrics) -> dict:
        text = metrics.render().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    a, b = samples(first), samples(second)
    assert a[("vllm:prompt_tokens_total", (("model_name", "a"),))] == 5
    assert b[("vllm:prompt_tokens_total", (("model_name", "b"),))] == 0
    key = ("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "a")))
    assert a[key] == 1
    assert not any(name == "vllm:request_success_total" for name, _ in b)
