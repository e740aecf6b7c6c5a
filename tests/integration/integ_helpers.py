"""Helpers of the integration tests: the test state dict, bit-exact comparison, addresses.

Owns the deterministic state dict (mixed dtypes, ~9 MiB so several readers get work),
``same_bits`` / ``assert_same``, S3 options for the test server, and ``serve``, which
puts a file under the nginx root and into a SeaweedFS bucket. Fixtures live in
``conftest.py`` beside this file.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorstream import StorageOptions


def make_state() -> dict[str, torch.Tensor]:
    """A deterministic state dict: 5 MiB, 2 MiB, 1 MiB tensors and small odd ones."""
    g = torch.Generator().manual_seed(1234)
    return {
        "embed.weight": torch.randn(1280, 1024, generator=g),  # 5 MiB f32
        "layer.0.attn.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
        "layer.0.mlp.weight": torch.randn(512, 1024, generator=g).to(torch.float16),
        "layer.0.norm.weight": torch.randn(1024, generator=g),
        "layer.1.mlp.weight": torch.randn(256, 1024, generator=g),
        "positions": torch.arange(4096, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "scale": torch.randn(7, 3, generator=g).to(torch.float64),
    }


STATE = make_state()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when dtype, shape and every byte agree (NaN-safe, -0.0-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(flat_a, flat_b)


def assert_same(loaded: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Every expected tensor is in ``loaded`` with identical bits, and nothing else is."""
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded[name]
        assert same_bits(got, tensor), f"{name}: {got.dtype}{tuple(got.shape)} differs"


def s3_options(server, **extra) -> StorageOptions:
    return StorageOptions(
        s3_endpoint=server.endpoint,
        s3_access_key_id=server.access_key,
        s3_secret_access_key=server.secret_key,
        s3_region=server.region,
        **extra,
    )


@dataclass(frozen=True)
class Served:
    """One checkpoint file reachable three ways."""

    local: Path
    http: str  # nginx URL with Range
    norange: str  # nginx URL that ignores Range
    s3: str  # s3://bucket/key
    relpath: str  # path under the nginx root


@dataclass(frozen=True)
class Checkpoint:
    tensors: Served
    safetensors: Served
    bucket: str
    options: StorageOptions  # explicit S3 credentials

    def file(self, fmt: str) -> Served:
        return self.tensors if fmt == "tensors" else self.safetensors


def serve(local: Path, relpath: str, http_server, s3_server, bucket: str) -> Served:
    """Copy ``local`` under the nginx root and into ``bucket``; return its addresses."""
    target = http_server.root / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(local, target)
    s3_server.client().upload_file(str(local), bucket, relpath)
    return Served(
        local,
        http_server.url(relpath),
        http_server.norange_url(relpath),
        f"s3://{bucket}/{relpath}",
        relpath,
    )
