"""Throughput of in-place chunked decryption per libsodium build (a measurement, not a test).

Run: ``.venv/bin/python tests/crypto/measure_secretbox.py [MiB]``. Prints GB/s for one
thread and for a thread pool as wide as the usable CPUs, for the system libsodium and
PyNaCl's bundled copy, over a pre-touched buffer (so page faults are not measured).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tensorstream.crypto import secretbox, sodium


def measure(which: str, nbytes: int, repeats: int = 3) -> dict[str, float]:
    lib = sodium.load(which)
    sodium._loaded = lib  # route secretbox through this build for the measurement
    key, nonce, chunk = bytes(range(32)), bytes(24), 2 << 20
    buf = np.ones(nbytes, dtype=np.uint8)
    macs = secretbox.encrypt_chunks(buf, key, nonce, chunk)
    cpus = len(os.sched_getaffinity(0))
    results = {}
    for label, pool in (("1 thread", None), (f"{cpus} threads", ThreadPoolExecutor(cpus))):
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            if pool is None:
                secretbox.decrypt_chunks(buf, key, nonce, chunk, macs)
            else:
                secretbox.decrypt_chunks_parallel(buf, key, nonce, chunk, macs, pool)
            best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
            assert secretbox.encrypt_chunks(buf, key, nonce, chunk) == macs  # back to ciphertext
        results[label] = round(best, 2)
    return results


if __name__ == "__main__":
    size = int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 128 << 20
    for which in ("system", "pynacl"):
        print(f"{sodium.load(which).describe()}: {measure(which, size)} GB/s", flush=True)
