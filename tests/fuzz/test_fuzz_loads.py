"""Seeded fuzz of every load path: no silent wrong data, no crash, no hang.

Mutants (bit flips, byte and length-field edits in the file header, index, tensor
headers and data, truncations, duplicated and deleted regions) of small files written
by tensorstream and by the real tensorizer 2.12.1, plain and encrypted, and of a
safetensors file, are loaded with ``verify_hash=True`` in child processes under an
address-space limit (``RLIMIT_AS``) and a per-mutant alarm. Each load must either
raise a ``tensorstream.errors`` exception or return tensors bit-identical to the
original's (safetensors files carry no hashes, so for them only the error type is
asserted). ``tensorstream inspect`` runs on a subset and must succeed or exit 2 with
one line. Children batch many mutants (torch imports once per child) and log each
mutant before touching it, so a crash by signal is still pinned on one mutant.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstream import TensorSerializer
from tensorstream.crypto import EncryptionParams
from tensorstream.deserialize.index import read_index
from tensorstream.formats.tensorizer import INDEX_OFFSET
from tensorstream.sources import open_source

pytestmark = pytest.mark.slow

#: fixed for CI; set TENSORSTREAM_FUZZ_SEED to explore other mutants locally
SEED = int(os.environ.get("TENSORSTREAM_FUZZ_SEED", "20261203"))
MUTANTS_PER_FILE = 72
BATCH = 30
#: torch plus a load peaks near 0.9 GiB of address space here; a forged shape would
#: ask for many GiB, far past this
AS_LIMIT = 3 << 30
PER_MUTANT_TIMEOUT = 20
CHILD = Path(__file__).with_name("fuzz_child.py")
INTERESTING = [
    0,
    1,
    2,
    7,
    0x7F,
    0xFF,
    0x7FFF,
    0xFFFF,
    0x7FFFFFFF,
    0xFFFFFFFF,
    1 << 32,
    (1 << 63) - 1,
    (1 << 64) - 1,
]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "w": torch.randn(4, 5, generator=g),
        "bf": torch.randn(6, generator=g).to(torch.bfloat16),
        "ids": torch.arange(9, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(1.5),
        "meta": torch.empty(4, device="meta"),
    }


def _originals(tmp: Path) -> list[dict[str, Any]]:
    """The files to mutate: (path, kind, key) of each."""
    import tensorizer

    sd = _state()
    out = []
    path = tmp / "ts.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict(sd)
    out.append({"path": str(path), "kind": "tensorizer", "key": None})
    path = tmp / "tz.tensors"
    tz = tensorizer.TensorSerializer(str(path))
    tz.write_state_dict(sd)
    tz.close()
    out.append({"path": str(path), "kind": "tensorizer", "key": None})
    path = tmp / "tree.tensors"  # structured names: int and str path parts
    with TensorSerializer(path) as s:
        s.write_state_dict({"layers": [{"w": sd["w"]}, {"w": sd["bf"]}], "ids": sd["ids"]})
    out.append({"path": str(path), "kind": "tensorizer", "key": None})
    enc = EncryptionParams.random()
    path = tmp / "enc.tensors"
    with TensorSerializer(path, encryption=enc) as s:
        s.write_state_dict({k: v for k, v in sd.items() if not v.is_meta})
    out.append({"path": str(path), "kind": "tensorizer", "key": enc.key.hex()})
    from safetensors.torch import save_file

    path = tmp / "st.safetensors"
    save_file({k: v for k, v in sd.items() if not v.is_meta}, str(path))
    out.append({"path": str(path), "kind": "safetensors", "key": None})
    return out


def _regions(path: str, kind: str) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges worth mutating, by role."""
    size = os.path.getsize(path)
    with open_source(path) as src:
        index = read_index(src)
    if kind == "safetensors":
        (n,) = struct.unpack("<Q", Path(path).read_bytes()[:8])
        data = [(r.data_offset, r.end) for r in index.records if r.data_length]
        return {"length": [(0, 8)], "header": [(8, 8 + n)], "data": data}
    first = min(r.header_offset for r in index.records)
    # the index entries, without the zero padding after them (plus a little of it)
    raw = Path(path).read_bytes()[INDEX_OFFSET:first]
    used = INDEX_OFFSET + len(raw.rstrip(b"\0")) + 8
    return {
        "file_header": [(0, INDEX_OFFSET)],
        "index": [(INDEX_OFFSET - 8, used)],
        "headers": [(r.header_offset, r.data_offset) for r in index.records],
        "data": [(r.data_offset, r.end) for r in index.records if r.data_length],
        "tail": [(max(r.end for r in index.records), size)],
    }


def _mutate(
    data: bytes, regions: dict[str, list[tuple[int, int]]], rng: random.Random
) -> tuple[str, bytes]:
    """One mutant and a short description of the edit."""
    buf = bytearray(data)
    if not buf:
        return "nothing-left", data
    roles = [r for r in regions if regions[r] and regions[r][0][1] > regions[r][0][0]]
    weights = {"headers": 4, "index": 4, "file_header": 2, "header": 6, "length": 1}
    role = rng.choices(roles, [weights.get(r, 1) for r in roles])[0]
    start, end = rng.choice(regions[role])
    end = min(end, len(buf))
    if end <= start:
        start, end = 0, len(buf)
    pos = rng.randrange(start, end)
    op = rng.choice(["bit", "bit", "byte", "int", "int", "truncate", "dup", "delete", "insert"])
    if op == "bit":
        buf[pos] ^= 1 << rng.randrange(8)
    elif op == "byte":
        buf[pos] = rng.choice(
            [0, 0xFF, rng.randrange(256), (buf[pos] + 1) & 0xFF, (buf[pos] - 1) & 0xFF]
        )
    elif op == "int":
        width = rng.choice([1, 2, 4, 8])
        old = int.from_bytes(buf[pos : pos + width], "little")
        value = rng.choice(INTERESTING + [old + 1, old - 1, len(buf), len(buf) + 1]) % (
            1 << 8 * width
        )
        buf[pos : pos + width] = value.to_bytes(width, "little")[: len(buf) - pos]
    elif op == "truncate":
        cut = rng.choice([pos, start, end, end - 1, max(0, end - 8)])
        del buf[cut:]
    elif op == "dup":
        a, b = rng.choice(regions[role])
        src_start, src_end = rng.choice(sum(regions.values(), []))
        chunk = data[src_start:src_end][:4096]
        buf[a : a + len(chunk)] = chunk
    elif op == "delete":
        del buf[pos : pos + rng.choice([1, 4, 8, end - pos])]
    else:
        buf[pos:pos] = bytes(rng.choice([1, 8, 4096]))
    return f"{role}:{op}@{pos}", bytes(buf)


def _run_child(job: dict[str, Any], work: Path, tag: str) -> dict[str, str]:
    """Run one batch; crashes and hangs are pinned on the mutant in flight, and the
    batch continues in a fresh child."""
    results: dict[str, str] = {}
    items = list(job["items"])
    attempt = 0
    while items:
        attempt += 1
        job_path = work / f"job-{tag}-{attempt}.json"
        out_path = work / f"out-{tag}-{attempt}.txt"
        job_path.write_text(json.dumps({**job, "items": items}))
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
        budget = 60 + PER_MUTANT_TIMEOUT * len(items)
        try:
            proc = subprocess.run(
                [sys.executable, str(CHILD), str(job_path), str(out_path)],
                capture_output=True,
                text=True,
                timeout=budget,
                env=env,
            )
            died = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-500:]}"
        except subprocess.TimeoutExpired:
            died = "hang (killed after the batch budget)"
        lines = out_path.read_text().splitlines() if out_path.exists() else []
        in_flight = None
        for line in lines:
            word, ident, *rest = line.split(" ", 2)
            if word == "START":
                in_flight = ident
            else:
                results[ident] = rest[0] if rest else ""
                in_flight = None
        if died is not None:
            if in_flight is None:
                raise AssertionError(f"fuzz child died outside any mutant: {died}")
            results[in_flight] = f"crash {died}"
        items = [i for i in items if i["id"] not in results]
    return results


def test_fuzz_loads(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    originals = _originals(tmp_path)
    items = []
    modes = ["mmap", "copy", "staged", "lazy"]
    for o_i, orig in enumerate(originals):
        data = Path(orig["path"]).read_bytes()
        regions = _regions(orig["path"], orig["kind"])
        for m in range(MUTANTS_PER_FILE):
            what, blob = _mutate(data, regions, rng)
            ident = f"{o_i}.{m}"
            path = tmp_path / f"mut-{ident}{Path(orig['path']).suffix}"
            path.write_bytes(blob)
            items.append(
                {
                    "id": ident,
                    "what": f"{Path(orig['path']).name} {what}",
                    "path": str(path),
                    "ref": orig["path"],
                    "kind": orig["kind"],
                    "key": orig["key"],
                    "mode": modes[m % len(modes)],
                    "inspect": m % 3 == 0,
                }
            )
    refs = [o for o in originals if o["kind"] == "tensorizer"]
    batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
    jobs = [
        {"as_limit": AS_LIMIT, "timeout": PER_MUTANT_TIMEOUT, "refs": refs, "items": b}
        for b in batches
    ]
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda j: _run_child(j[1], tmp_path, str(j[0])), enumerate(jobs)))
    results = {k: v for part in parts for k, v in part.items()}
    by_id = {i["id"]: i for i in items}
    assert set(results) == set(by_id)
    bad = [
        f"{ident} [{by_id[ident]['what']}, {by_id[ident]['mode']}]: {outcome}"
        for ident, outcome in sorted(results.items())
        if not (outcome == "ok" or outcome == "loaded" or outcome.startswith("err "))
    ]
    assert not bad, "\n".join(bad)
    # the fuzz must exercise both outcomes, or it tests nothing
    outcomes = [v.split()[0] for v in results.values()]
    assert outcomes.count("err") > len(items) // 4 and outcomes.count("ok") > 10


def test_inspect_cli_one_line_on_mutants(tmp_path: Path) -> None:
    """The real ``tensorstream inspect`` process on a few mutants: one line, no traceback."""
    rng = random.Random(SEED + 1)
    originals = _originals(tmp_path)
    checked = 0
    for orig in originals:
        data = Path(orig["path"]).read_bytes()
        regions = _regions(orig["path"], orig["kind"])
        for _ in range(2):
            _, blob = _mutate(data, regions, rng)
            path = tmp_path / f"cli-{checked}{Path(orig['path']).suffix}"
            path.write_bytes(blob)
            proc = subprocess.run(
                [sys.executable, "-m", "tensorstream", "inspect", str(path)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            checked += 1
            assert "Traceback" not in proc.stderr, proc.stderr
            if proc.returncode:
                assert proc.returncode == 2, proc.stderr
                assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
