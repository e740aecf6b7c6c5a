"""Shared helpers for tests/core: deterministic tensors of every dtype, bit-exact compares."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

#: every dtype tensorizer 2.12.1 writes (uint16/32/64 included: it handles them on torch 2.13)
DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]

SHAPES = {"scalar": (), "empty": (0, 5), "vec": (7,), "cube": (2, 3, 4)}


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (bools are 0/1) — NaN patterns included on purpose."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return bytes(t.view(torch.uint8).numpy().tobytes())


def assert_same(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """Same dtype, shape and bits."""
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (name, got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want), f"{name}: bits differ"


def dtype_matrix(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype in every shape, plus non-contiguous views, as a flat state dict."""
    out: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(DTYPES):
        for j, (label, shape) in enumerate(SHAPES.items()):
            out[f"{dname(dt)}.{label}"] = make(dt, shape, seed + 10 * i + j)
        base = make(dt, (6, 8), seed + 10 * i + 9)
        out[f"{dname(dt)}.transposed"] = base.t()
        out[f"{dname(dt)}.strided"] = base[::2, 1::3]
    return out


OPAQUE = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


def tensorizer_readable(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop empty opaque-dtype tensors: tensorizer 2.12.1 cannot open a file holding one
    (``numpy.dtype('<V2\\0torch.bfloat16')`` in ``deserialized_length``), even its own."""
    return {k: v for k, v in sd.items() if not (v.numel() == 0 and v.dtype in OPAQUE)}


def nested_state_dict() -> dict[Any, Any]:
    return {
        "model": {
            "layers": [
                {"w": make(torch.float32, (3, 4), 1), "b": make(torch.bfloat16, (4,), 2)},
                {"w": make(torch.float32, (3, 4), 3), "b": make(torch.bfloat16, (4,), 4)},
            ],
            "steps": [make(torch.int64, (2,), 5), [make(torch.uint8, (3,), 7)]],
        },
        "top": make(torch.float16, (5,), 6),
    }


def assert_tree_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert_same(got, want, path)
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), (path, type(got))
        assert set(got.keys()) == set(want.keys()), (path, set(got.keys()), set(want.keys()))
        for k in want:
            assert_tree_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)), (path, type(got))
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_tree_same(g, w, f"{path}[{i}]")
    else:
        raise AssertionError(f"{path}: unexpected {type(want)}")


class Net(torch.nn.Module):
    """Parameters, a persistent and a non-persistent buffer, a root-level tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
        self.head = torch.nn.Linear(5, 3, bias=False)
        self.register_buffer("steps", torch.arange(4, dtype=torch.int64))
        self.block.register_buffer("scale", torch.full((5,), 0.5), persistent=False)
        self.root_param = torch.nn.Parameter(torch.randn(2, 2))

    def randomize(self, seed: int) -> Net:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g))
                else:
                    t.copy_(torch.randint(0, 100, t.shape, generator=g))
        return self


def all_tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (persistent or not) by dotted name."""
    out = dict(m.named_parameters())
    out.update(dict(m.named_buffers()))
    return out
