"""The synthetic Llama-shaped bf16 checkpoint and its files in the bench cache dir.

The checkpoint is random but deterministic (seeded), shaped like TinyLlama-1.1B (hidden 2048,
intermediate 5632, 32 heads, 4 KV heads, vocab 32000) with as many layers as reach the
requested size. Below ~400 MiB the width shrinks instead, so quick runs and the smoke test
still get a Llama-like set of tensors.

Each format is written once into ``<cache_dir>/llama-<size>mib-s<seed>/`` and reused:

* ``tensorizer.tensors`` — written by tensorizer 2.12.1 (its own loads read this one);
* ``tensorstream.tensors`` — written by tensorstream (ours read this one), when importable;
* ``model.safetensors`` — written by safetensors.

Files are written to a temporary name and renamed, so an interrupted run never leaves a
half file that a later run would take for cached. ``python -m bench.checkpoint`` builds them
in a separate process so the harness itself never holds the tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_FILES",
    "CheckpointSpec",
    "checkpoint_dir",
    "ensure_checkpoint",
    "make_state_dict",
    "read_manifest",
    "tensor_shapes",
]

# format name -> file name inside the checkpoint dir
FORMAT_FILES: dict[str, str] = {
    "safetensors": "model.safetensors",
    "tensorizer": "tensorizer.tensors",
    "tensorstream": "tensorstream.tensors",
}

_FULL_HIDDEN = 2048
_FULL_INTERMEDIATE = 5632
_FULL_VOCAB = 32000
_HEAD_DIM = 64
_KV_GROUP = 8  # 32 query heads share 4 KV heads in TinyLlama


@dataclass(frozen=True)
class CheckpointSpec:
    """Shape of the synthetic checkpoint.

    Attributes:
        hidden: model width.
        intermediate: MLP width.
        vocab: vocabulary size (embedding and lm_head rows).
        layers: decoder layers.
        seed: generator seed; same spec, same bytes.
    """

    hidden: int
    intermediate: int
    vocab: int
    layers: int
    seed: int = 0

    @property
    def kv_dim(self) -> int:
        heads = self.hidden // _HEAD_DIM
        return max(1, heads // _KV_GROUP) * _HEAD_DIM

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (bf16)."""
        return 2 * sum(math.prod(s) for s in tensor_shapes(self).values())

    @classmethod
    def for_size(cls, size_mib: int, seed: int = 0, vocab: int | None = None) -> CheckpointSpec:
        """Pick Llama-like dimensions whose total is close to ``size_mib`` MiB.

        Args:
            size_mib: wanted total tensor bytes in MiB (>= 1).
            seed: generator seed.
            vocab: a fixed vocabulary size (to match a real tokenizer); by default 32000,
                shrunk with the width below full width.

        Returns:
            The spec. At full width it adds layers; below that it shrinks width with 4 layers.
        """
        target = size_mib * 2**20
        v = _FULL_VOCAB if vocab is None else vocab
        full = cls(_FULL_HIDDEN, _FULL_INTERMEDIATE, v, 0, seed)
        per_layer = cls(_FULL_HIDDEN, _FULL_INTERMEDIATE, v, 1, seed).nbytes - full.nbytes
        layers = round((target - full.nbytes) / per_layer)
        if layers >= 4:
            return cls(_FULL_HIDDEN, _FULL_INTERMEDIATE, v, layers, seed)
        # Bytes grow with width squared at a fixed layer count; scale all widths by k.
        four = cls(_FULL_HIDDEN, _FULL_INTERMEDIATE, v, 4).nbytes
        if vocab is None:
            k = math.sqrt(target / four)
        else:  # the embeddings grow only linearly: solve a*k^2 + b*k = target
            b = full.nbytes
            a = four - b
            k = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
        hidden = max(_HEAD_DIM, round(_FULL_HIDDEN * k / _HEAD_DIM) * _HEAD_DIM)
        inter = max(64, round(_FULL_INTERMEDIATE * k / 64) * 64)
        if vocab is None:
            v = max(64, round(_FULL_VOCAB * k / 64) * 64)
        return cls(hidden, inter, v, 4, seed)

    @property
    def slug(self) -> str:
        return (
            f"llama-h{self.hidden}-i{self.intermediate}-v{self.vocab}-l{self.layers}-s{self.seed}"
        )


def tensor_shapes(spec: CheckpointSpec) -> dict[str, tuple[int, ...]]:
    """Tensor names (as in Hugging Face Llama) and shapes, in file order.

    Args:
        spec: the checkpoint spec.

    Returns:
        Ordered mapping name -> shape.
    """
    h, i, kv = spec.hidden, spec.intermediate, spec.kv_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (h, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.vocab, h)
    return shapes


def make_state_dict(spec: CheckpointSpec) -> dict[str, torch.Tensor]:
    """Build the checkpoint's tensors in memory (bf16, CPU, deterministic).

    Args:
        spec: the checkpoint spec.

    Returns:
        name -> tensor; weights ~N(0, 0.02), norms ~1.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(spec).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.05, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def checkpoint_dir(cache_dir: Path, spec: CheckpointSpec) -> Path:
    """Directory holding every format of ``spec`` under ``cache_dir``."""
    return Path(cache_dir) / spec.slug


def read_manifest(directory: Path) -> dict:
    """The manifest of a checkpoint dir: spec, per-format file/bytes or unavailable reason."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return {"formats": {}}
    return json.loads(path.read_text())


def _write_format(fmt: str, sd: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(tmp))
    elif fmt == "tensorizer":
        from tensorizer import TensorSerializer

        ser = TensorSerializer(str(tmp))
        ser.write_state_dict(sd)
        ser.close()
    elif fmt == "tensorstream":
        from tensorstream import TensorSerializer  # type: ignore[attr-defined]

        ser = TensorSerializer(str(tmp))
        ser.write_state_dict(sd)
        ser.close()
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known: {sorted(FORMAT_FILES)}")
    os.replace(tmp, path)


def _build(spec: CheckpointSpec, directory: Path, formats: list[str]) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(directory)
    manifest["spec"] = asdict(spec)
    manifest["nbytes"] = spec.nbytes
    manifest["tensors"] = len(tensor_shapes(spec))
    sd: dict | None = None
    for fmt in formats:
        path = directory / FORMAT_FILES[fmt]
        entry = manifest["formats"].get(fmt, {})
        if path.exists() and entry.get("status") == "ok":
            continue
        if sd is None:
            sd = make_state_dict(spec)
        try:
            _write_format(fmt, sd, path)
            manifest["formats"][fmt] = {
                "status": "ok",
                "file": path.name,
                "size": path.stat().st_size,
            }
        except Exception as exc:  # a missing writer makes its cases unavailable, not the run fail
            manifest["formats"][fmt] = {
                "status": "unavailable",
                "reason": f"{type(exc).__name__}: {exc}",
            }
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def ensure_checkpoint(
    cache_dir: Path, spec: CheckpointSpec, formats: list[str] | None = None
) -> tuple[Path, dict]:
    """Write any missing format of the checkpoint, in a child process.

    Args:
        cache_dir: the bench cache dir (``.bench/`` by default).
        spec: the checkpoint spec.
        formats: formats to make sure of; default all of ``FORMAT_FILES``.

    Returns:
        (checkpoint dir, manifest). A format that could not be written has
        ``status == "unavailable"`` and a ``reason`` in the manifest.

    Raises:
        RuntimeError: the child process failed outright.
    """
    import subprocess

    directory = checkpoint_dir(cache_dir, spec)
    formats = list(formats or FORMAT_FILES)
    manifest = read_manifest(directory)
    missing = [
        f
        for f in formats
        if manifest["formats"].get(f, {}).get("status") != "ok"
        or not (directory / FORMAT_FILES[f]).exists()
    ]
    if missing:
        cmd = [sys.executable, "-m", "bench.checkpoint", "--dir", str(directory)]
        cmd += ["--spec", json.dumps(asdict(spec)), "--formats", ",".join(missing)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"writing checkpoint in {directory} failed:\n{done.stderr[-4000:]}")
        manifest = read_manifest(directory)
    return directory, manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write the synthetic bench checkpoint")
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--spec", required=True, help="CheckpointSpec as JSON")
    ap.add_argument("--formats", default=",".join(FORMAT_FILES))
    args = ap.parse_args(argv)
    spec = CheckpointSpec(**json.loads(args.spec))
    manifest = _build(spec, args.dir, [f for f in args.formats.split(",") if f])
    print(json.dumps(manifest["formats"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
