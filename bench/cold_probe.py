"""Probe cold-page-cache reads: what moves a file from disk into memory fastest here.

``python -m bench.cold_probe FILE [--repeats 2]`` (root: it drops the page cache before
every measurement, for the whole machine) reads FILE once per variant, each in a fresh
process, interleaved, and prints the median GB/s of getting every byte into memory:

* ``mmap-willneed``: private map + ``MADV_WILLNEED``, pages faulted by a pass over them
  (how mapped CPU loads read a cold file);
* ``mmap-populate-t{1,2}``: the map faulted in by ``MADV_POPULATE_READ`` over 8 MiB
  pieces on 1/2 threads, then the same pass;
* ``pread-{1,8,32}m-touched``: one thread, ``preadv`` in 1/8/32 MiB pieces into memory
  touched before timing (the ``readinto-touched`` reference);
* ``pread-8m-fresh-t{1,2,4}``: 8 MiB pieces into a fresh arena on 1/2/4 threads (how
  unaligned tensors, verified and remote loads read);
* ``pread-8m-fresh-t4-fds``: 4 threads, each with its own descriptor (and so its own
  read-ahead state) instead of one shared descriptor;
* ``pread-8m-fresh-seq``: the same, one thread, after ``posix_fadvise(SEQUENTIAL)``;
* ``odirect-8m-fresh-t{1,2}``: ``O_DIRECT`` reads, bypassing the page cache, into the arena.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

VARIANTS = (
    "mmap-willneed",
    "mmap-populate-t1",
    "mmap-populate-t2",
    "pread-1m-touched",
    "pread-8m-touched",
    "pread-32m-touched",
    "pread-8m-fresh-t1",
    "pread-8m-fresh-t2",
    "pread-8m-fresh-t4",
    "pread-8m-fresh-t4-fds",
    "pread-8m-fresh-seq",
    "odirect-8m-fresh-t1",
    "odirect-8m-fresh-t2",
)


_MADV_POPULATE_READ = 22  # Linux 5.14+; not exported by Python 3.11's mmap module


def _drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _child(variant: str, path: str) -> float:
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path) // (1 << 20) * (1 << 20)  # whole MiB: O_DIRECT needs it
    piece = {"1m": 1 << 20, "32m": 32 << 20}.get(variant.split("-")[1], 8 << 20)
    own_fds = variant.endswith("-fds")
    if own_fds:
        variant = variant.removesuffix("-fds")
    threads = int(variant.rsplit("-t", 1)[1]) if "-t" in variant[-3:] else 1
    arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dest = memoryview(arena)
    if variant.endswith("touched"):
        for i in range(0, size, mmap.PAGESIZE):
            arena[i] = 1
    flags = os.O_RDONLY | (os.O_DIRECT if variant.startswith("odirect") else 0)
    fd = os.open(path, flags)
    _drop()
    t0 = time.perf_counter()
    if variant.startswith("mmap"):
        fmap = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        if variant == "mmap-willneed":
            fmap.madvise(mmap.MADV_WILLNEED)
        else:
            share = -(-size // threads // piece) * piece

            def populate(k: int) -> None:
                for s in range(k * share, min(size, (k + 1) * share), piece):
                    fmap.madvise(_MADV_POPULATE_READ, s, min(piece, size - s))

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(populate, range(threads)))
        total = 0
        for i in range(0, size, mmap.PAGESIZE):
            total += fmap[i]
    else:
        if variant.endswith("seq"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
        starts = list(range(0, size, piece))

        def read(start: int, f: int = fd) -> None:
            n = min(piece, size - start)
            done = 0
            while done < n:
                done += os.preadv(f, [dest[start + done : start + n]], start + done)

        def share_of(k: int) -> None:
            f = os.open(path, flags) if own_fds else fd
            try:
                for s in starts[k * share : (k + 1) * share]:
                    read(s, f)
            finally:
                if own_fds:
                    os.close(f)

        if threads == 1:
            for s in starts:
                read(s)
        else:
            # contiguous shares per thread, as the loaders' planned ranges are
            share = -(-len(starts) // threads)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(share_of, range(threads)))
    return size / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.file)))
        return 0
    wanted = args.variants.split(",")
    results: dict[str, list[float]] = {v: [] for v in wanted}
    for _ in range(args.repeats):
        for v in wanted:
            cmd = [sys.executable, "-m", "bench.cold_probe", args.file, "--child", v]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[v].append(json.loads(out.stdout))
    print(f"| variant (cold, {os.path.getsize(args.file) >> 20} MiB) | median GB/s | min-max |")
    print("|---|---:|---:|")
    for v, xs in results.items():
        print(f"| {v} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
