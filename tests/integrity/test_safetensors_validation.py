"""Issue #15: safetensors headers validated like the safetensors library does.

Each case breaks one rule; the real safetensors library (the oracle) must refuse it
too (or, for duplicate keys, silently keep one: we refuse on purpose), and we must
raise a ``FormatError`` naming the file and the field, never TypeError, ValueError,
OverflowError or RecursionError.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tensorstream import TensorDeserializer
from tensorstream.errors import FormatError, TensorStreamError

A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
B = {"dtype": "I32", "shape": [1], "data_offsets": [8, 12]}
DATA = bytes(range(12))


def _file(header: Any, data: bytes = DATA) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


#: (id, file bytes, words our message must contain)
CASES: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("header-past-eof", struct.pack("<Q", 1 << 40) + b"{}", ("truncated",)),
    ("not-json", _file(b"{not json"), ("not valid JSON",)),
    ("not-utf8", _file(b'{"\xff": 1}'), ("not valid JSON",)),
    ("not-object", _file(b"[1, 2]", b""), ("neither a tensorizer",)),
    ("entry-not-object", _file({"a": [1]}), ("'a'", "not an object")),
    ("missing-dtype", _file({"a": {"shape": [2], "data_offsets": [0, 8]}}), ("'a'", "'dtype'")),
    ("unknown-dtype", _file({"a": {**A, "dtype": "F33"}, "b": B}), ("'a'", "'dtype'", "F33")),
    ("dtype-not-str", _file({"a": {**A, "dtype": 4}, "b": B}), ("'a'", "'dtype'")),
    ("shape-negative", _file({"a": {**A, "shape": [-2]}, "b": B}), ("'a'", "'shape'")),
    ("shape-float", _file({"a": {**A, "shape": [2.0]}, "b": B}), ("'a'", "'shape'")),
    ("shape-bool", _file({"a": {**A, "shape": [True, 2]}, "b": B}), ("'a'", "'shape'")),
    ("shape-not-list", _file({"a": {**A, "shape": 2}, "b": B}), ("'a'", "'shape'")),
    ("offsets-three", _file({"a": {**A, "data_offsets": [0, 8, 8]}, "b": B}), ("'data_offsets'",)),
    ("offsets-float", _file({"a": {**A, "data_offsets": [0, 8.0]}, "b": B}), ("'data_offsets'",)),
    ("offsets-reversed", _file({"a": {**A, "data_offsets": [8, 0]}, "b": B}), ("'a'", "[8, 0]")),
    ("offsets-negative", _file({"a": {**A, "data_offsets": [-8, 0]}, "b": B}), ("'a'",)),
    ("offsets-past-data", _file({"a": A, "b": {**B, "data_offsets": [8, 16]}}), ("'b'",)),
    ("size-mismatch", _file({"a": {**A, "shape": [3]}, "b": B}), ("'a'", "needs 12")),
    (
        "gap",
        _file(
            {"a": {**A, "data_offsets": [1, 9]}, "b": {**B, "data_offsets": [9, 13]}}, DATA + b"\0"
        ),
        ("'a'", "gap"),
    ),
    ("overlap", _file({"a": A, "b": {**B, "data_offsets": [4, 8]}}, DATA[:8]), ("'b'", "overlaps")),
    ("alias", _file({"a": A, "b": {**A}}, DATA[:8]), ("overlaps or aliases",)),
    ("trailing-data", _file({"a": A, "b": B}, DATA + b"junk"), ("cover 12 bytes",)),
    ("short-cover", _file({"a": A}, DATA), ("cover 8 bytes",)),
    ("metadata-not-dict", _file({"__metadata__": ["x"], "a": A, "b": B}), ("'__metadata__'",)),
    ("metadata-int-value", _file({"__metadata__": {"k": 1}, "a": A, "b": B}), ("'__metadata__'",)),
    (
        "metadata-nested",
        _file({"__metadata__": {"k": {"x": "y"}}, "a": A, "b": B}),
        ("'__metadata__'",),
    ),
    ("deep-nesting", _file(b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"), ("nests too deeply",)),
    (
        "huge-int",
        _file(b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}'),
        ("not valid JSON",),
    ),
    ("huge-shape", _file({"a": {**A, "shape": [0, 1 << 62, 1 << 62]}, "b": B}), ("'a'",)),
    ("huge-offsets", _file({"a": {**A, "data_offsets": [0, 1 << 70]}, "b": B}), ("'a'",)),
]
DUPLICATE = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'


@pytest.mark.parametrize(("blob", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_rule_is_refused_with_field(tmp_path, blob: bytes, words: tuple[str, ...]) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises((SafetensorError, Exception)) as oracle:
        st_load(blob)
    assert not isinstance(oracle.value, AssertionError)
    with pytest.raises(FormatError) as info:
        TensorDeserializer(path, device="cpu")
    msg = str(info.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg


def test_duplicate_keys_refused(tmp_path) -> None:
    """The safetensors library keeps one of two same-named tensors; we refuse the file."""
    blob = _file(DUPLICATE, DATA[:8])
    assert list(st_load(blob)) == ["a"]  # the oracle silently accepts it
    path = tmp_path / "dup.safetensors"
    path.write_bytes(blob)
    with pytest.raises(FormatError, match="names 'a' twice"):
        TensorDeserializer(path, device="cpu")


def test_valid_files_still_load(tmp_path) -> None:
    sd = {
        "w": torch.randn(3, 4),
        "e": torch.empty(0, 3),
        "z": torch.empty(0),
        "b": torch.arange(5, dtype=torch.int16),
    }
    blob = st_save(sd, metadata={"format": "pt"})
    path = tmp_path / "ok.safetensors"
    path.write_bytes(blob)
    d = TensorDeserializer(path, device="cpu")
    for k, t in sd.items():
        assert torch.equal(d[k], t), k
    assert d.index.metadata == {"format": "pt"}
    # null metadata and unknown entry fields are accepted, as the library does
    loose = _file({"__metadata__": None, "a": {**A, "extra": 1}, "b": B})
    assert set(st_load(loose)) == {"a", "b"}
    path.write_bytes(loose)
    assert set(TensorDeserializer(path, device="cpu").keys()) == {"a", "b"}


def test_mutants_raise_only_tensorstream_errors(tmp_path) -> None:
    """Every single-byte edit of a small file's header: loads or a FormatError; never
    TypeError / ValueError / OverflowError / RecursionError from the parser."""
    blob = bytearray(st_save({"a": torch.ones(2), "b": torch.arange(3, dtype=torch.int64)}))
    (hlen,) = struct.unpack_from("<Q", blob)
    path = tmp_path / "m.safetensors"
    replacements = [ord(c) for c in '0-9"{}[],:. e'] + [0, 0xFF]
    for pos in range(8 + hlen):
        for value in replacements[pos % 3 :: 3]:
            mutant = bytearray(blob)
            mutant[pos] = value
            path.write_bytes(bytes(mutant))
            try:
                TensorDeserializer(path, device="cpu")
            except TensorStreamError:
                pass


def test_verify_hash_is_refused_for_safetensors(tmp_path) -> None:
    """safetensors stores no hashes: verify_hash=True must not return unchecked bytes."""
    import torch
    from safetensors.torch import save_file

    from tensorstream import TensorDeserializer
    from tensorstream.errors import ConfigError

    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.arange(6.0)}, str(path))
    with pytest.raises(ConfigError, match="stores no hashes.*without verify_hash"):
        TensorDeserializer(path, device="cpu", verify_hash=True)
    with TensorDeserializer(path, device="cpu") as loaded:
        assert torch.equal(loaded["w"], torch.arange(6.0))
