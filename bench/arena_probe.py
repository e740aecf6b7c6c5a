"""Probe the choices behind ``deserialize/arena.py``: where fresh CPU memory comes from.

``python -m bench.arena_probe [--size-mib 512] [--repeats 3]`` copies a file from a warm
page cache into fresh memory, each variant in its own process (memory state matters),
and prints the median GB/s of allocate + copy:

* ``torch-empty``: one ``torch.empty`` per tensor (the allocator before arenas);
* ``arena-4k``: one anonymous private mapping, no advice (4 KiB pages);
* ``arena-thp``: the same with ``MADV_HUGEPAGE`` (what loads use);
* ``arena-thp-populate``: plus ``MADV_POPULATE_WRITE`` on the allocating thread first;
* ``arena-thp-2threads``: huge pages, the copy split over two threads (faults taken on
  the copying threads, as reader threads do);
* ``arena-thp-64m`` / ``arena-thp-1g``: arena granularity, 64 MiB arenas or one arena.

Tensors are 16 MiB each (a Llama MLP matrix is 22-44 MiB in bf16).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = (
    "torch-empty",
    "arena-4k",
    "arena-thp",
    "arena-thp-populate",
    "arena-thp-2threads",
    "arena-thp-64m",
    "arena-thp-1g",
)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module
_TENSOR = 16 << 20


def _child(variant: str, path: str, size: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    torch.set_num_threads(1)
    fd = os.open(path, os.O_RDONLY)
    src_map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    src = torch.frombuffer(src_map, dtype=torch.uint8)
    int(src[::4096].sum())  # map the source pages in before timing
    count = size // _TENSOR
    t0 = time.perf_counter()
    if variant == "torch-empty":
        dests = [torch.empty(_TENSOR, dtype=torch.uint8) for _ in range(count)]
    else:
        arena_bytes = {"arena-thp-64m": 64 << 20}.get(variant, size)
        per = arena_bytes // _TENSOR
        dests, maps = [], []
        for first in range(0, count, per):
            m = mmap.mmap(-1, arena_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if variant != "arena-4k":
                m.madvise(mmap.MADV_HUGEPAGE)
            if variant == "arena-thp-populate":
                m.madvise(_MADV_POPULATE_WRITE)
            maps.append(m)
            for j in range(min(per, count - first)):
                dests.append(
                    torch.frombuffer(m, dtype=torch.uint8, count=_TENSOR, offset=j * _TENSOR)
                )

    def copy(i: int) -> None:
        dests[i].copy_(src[i * _TENSOR : (i + 1) * _TENSOR])

    if variant == "arena-thp-2threads":
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(copy, range(count)))
    else:
        for i in range(count):
            copy(i)
    return count * _TENSOR / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        variant, path, size = args.child
        print(json.dumps(_child(variant, path, int(size))))
        return 0
    size = args.size_mib << 20
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR"), delete=False) as f:
        block = os.urandom(1 << 20)
        for _ in range(args.size_mib):
            f.write(block)
        path = f.name
    try:
        results: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):  # interleaved, so load from elsewhere hits all alike
            for v in VARIANTS:
                out = subprocess.run(
                    [sys.executable, "-m", "bench.arena_probe", "--child", v, path, str(size)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[v].append(json.loads(out.stdout))
        print(f"| variant ({args.size_mib} MiB, 16 MiB tensors) | median GB/s | min-max |")
        print("|---|---:|---:|")
        for v, xs in results.items():
            print(f"| {v} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} |")
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
