"""Sharded safetensors index files (``*.index.json``): malformed ones raise FormatError."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tensorstream import TensorDeserializer
from tensorstream.errors import FormatError


@pytest.fixture()
def checkpoint(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(tmp_path / "s2.safetensors"))
    return tmp_path


def _index(tmp_path, text: str):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    return path


def test_valid_index_loads(checkpoint) -> None:
    path = _index(checkpoint, '{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}')
    d = TensorDeserializer(path, device="cpu")
    assert torch.equal(d["a"], torch.ones(2)) and torch.equal(d["b"], torch.ones(3))


def test_tensor_listed_twice_is_refused(checkpoint) -> None:
    """Regression: the second entry silently won, loading 'a' from s2 (zeros)."""
    path = _index(
        checkpoint,
        '{"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors", "b": "s2.safetensors"}}',
    )
    with pytest.raises(FormatError, match="'a' appears twice"):
        TensorDeserializer(path, device="cpu")


@pytest.mark.parametrize(
    "text",
    [
        '{"weight_map": ' + "[" * 50000 + "]" * 50000 + "}",  # RecursionError before
        '{"weight_map": {}, "n": ' + "9" * 5000 + "}",  # ValueError (int digits) before
    ],
    ids=["deep", "huge-int"],
)
def test_hostile_json_is_a_format_error(checkpoint, text) -> None:
    with pytest.raises(FormatError, match="not a sharded-checkpoint index"):
        TensorDeserializer(_index(checkpoint, text), device="cpu")
