"""Benchmark harness: tensorstream side by side with its peers, in one run.

Modules, one job each:

* ``checkpoint`` — the synthetic Llama-shaped bf16 checkpoint, written once per size into
  the cache dir in every format a case needs.
* ``cases`` — the case registry: what runs (name, peer, source, operation, worker, params).
* ``workers`` — the code that runs inside a fresh process per measurement and prints one
  JSON line (``python -m bench.workers '<spec json>'``).
* ``touch`` — the every-byte pass and checksum that every load case ends with.
* ``sources`` — where the bytes come from (local files now; HTTP and S3 servers plug in here).
* ``report`` — medians, ratios, markdown tables, the PNG plot, ``docs/benchmarks.md``.
* ``run`` — the command line: ``python -m bench.run [--quick] [--out docs/]``.
"""
