"""Tensor-parallel loading: per-rank bytes read, time to loaded and host memory.

``python -m bench.tp_bench [--layers 15] [--hidden 2048] [--repeats 3]
[--sources local,http,http-slow,s3] [--out DIR]`` writes a synthetic Llama (bf16,
hidden 2048, GQA 16/4 heads, MLP 5632, vocab 32000; ~1.5 GiB at the default 15 layers)
once as one unsharded ``model.tensors`` and once as 2 rank files (the engine's plan:
vocab-split embeddings and head), serves the directory from local disk, nginx and
SeaweedFS (loopback, ``bench/servers.py``), and for each case starts one process per
rank at the same time. Each rank loads what the engine would
(``engine/parallel/weights.py``: its rank file whole, or its slices of the unsharded
file with the Llama TP plan) into fresh memory (``use_mmap=False``, so local bytes are
really read) and reports bytes read, bytes held, seconds and RSS. Cases:

* ``tp1``: one process, the whole unsharded file;
* ``tp2-unsharded``: two ranks slicing the one file (default ``max_gap``);
* ``tp2-unsharded-gap0``: the same with ``max_gap=0`` (dim-1 slices read exactly, one
  ranged read per row piece) — the read-through-vs-requests trade-off (not run on
  ``http-slow``, where each of its ~60k requests waits on a throttled connection);
* ``tp2-rankfiles``: two ranks, each its own file.

Sources: ``local``, ``http`` and ``s3`` have a warm page cache behind loopback, so the
client CPU is the bottleneck. ``http-slow`` is nginx with a per-connection
``limit_rate`` (16 MiB/s), the way object stores cap each connection: there the
source is the bottleneck and throughput grows with connections (readers x ranks).

``python -m bench.tp_bench --head-step`` instead times the vocab-parallel head alone
(SmolLM2 shape: vocab 49152, hidden 576, bf16, one thread per rank, gloo): rank 0's
replicated ``F.linear`` against broadcast of the picked rows + each rank's slice +
gather to rank 0, for 2 and 3 ranks and 1 and 8 rows (median of 50 steps per run).

Each case runs ``--repeats`` times; a row holds the medians (and every run's figure)
plus the ranks of the median run. ``rss_ok`` says whether every rank's RSS stayed
within its shard (bytes held) + 256 MiB. Prints a JSON object with the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("tp1", "tp2-unsharded", "tp2-unsharded-gap0", "tp2-rankfiles")
#: Throttled connections: a request per dim-1 row piece (gap0) would take minutes.
SLOW_CASES = ("tp1", "tp2-unsharded", "tp2-rankfiles")
SOURCES = ("local", "http", "http-slow", "s3")
#: The issue's host-memory target: a rank's RSS within its shard plus this.
RSS_SLACK = 256 << 20


def synthetic_llama(layers: int, hidden: int = 2048) -> dict[str, Any]:
    """A random bf16 Llama state dict (Hugging Face names); MLP 2.75x hidden, 16/4 heads."""
    import torch

    h, i, v, heads, kv = hidden, hidden * 11 // 4, 32000, 16, 4
    d = h // heads
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        state.update(
            {
                p + "self_attn.q_proj.weight": rand(heads * d, h),
                p + "self_attn.k_proj.weight": rand(kv * d, h),
                p + "self_attn.v_proj.weight": rand(kv * d, h),
                p + "self_attn.o_proj.weight": rand(h, heads * d),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": rand(h),
                p + "post_attention_layernorm.weight": rand(h),
            }
        )
    state["model.norm.weight"] = rand(h)
    return state


def write_model(directory: Path, layers: int, hidden: int = 2048) -> int:
    """Write model.tensors and the 2 rank files; returns the model's bytes."""
    from tensorstream import TensorSerializer
    from tensorstream.engine.parallel.plan import LLAMA_TP_PLAN
    from tensorstream.serialize.sharded import serialize_sharded

    state = synthetic_llama(layers, hidden)
    with TensorSerializer(directory / "model.tensors") as out:
        out.write_state_dict(state)
    serialize_sharded(
        state, directory / "model-rank-%03d.tensors", world_size=2, plan=LLAMA_TP_PLAN
    )
    return sum(t.nbytes for t in state.values())


def worker(rank: int, world: int, uri: str, options: dict[str, Any], max_gap: int | None) -> None:
    """One rank's load; prints a JSON line."""
    from tensorstream import StorageOptions, TensorDeserializer
    from tensorstream.deserialize.shard import ShardSpec
    from tensorstream.engine.parallel.plan import LLAMA_TP_PLAN

    storage = None
    if options:
        storage = StorageOptions(
            s3_endpoint=options["endpoint"],
            s3_access_key_id=options["access_key"],
            s3_secret_access_key=options["secret_key"],
            s3_region=options.get("region"),
        )
    spec = ShardSpec(rank, world, LLAMA_TP_PLAN, even=True, max_gap=max_gap) if world > 1 else None
    started = time.perf_counter()
    with TensorDeserializer(uri, device="cpu", shard=spec, storage=storage, use_mmap=False) as d:
        nbytes = d.total_bytes_read
        held = sum(t.nbytes for t in d.values())
    seconds = time.perf_counter() - started
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    print(json.dumps({"rank": rank, "bytes": nbytes, "held": held, "s": seconds, "rss": rss}))


def _run_once(case: str, uri: str, options: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    world = 1 if case == "tp1" else 2
    gap = "0" if case.endswith("gap0") else "none"
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.tp_bench",
                "--worker",
                str(r),
                str(world),
                uri,
                json.dumps(options),
                gap,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    ranks = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"{case}: a rank failed (exit {p.returncode})")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    return ranks, time.perf_counter() - started


def run_case(case: str, uri_of: Any, options: dict[str, Any], repeats: int = 1) -> dict[str, Any]:
    """Run ``case`` ``repeats`` times; medians, every run's figures, the median run's ranks."""
    uri = uri_of("model-rank-%03d.tensors" if case == "tp2-rankfiles" else "model.tensors")
    runs = [_run_once(case, uri, options) for _ in range(repeats)]
    slowest = [max(r["s"] for r in ranks) for ranks, _ in runs]
    median = statistics.median(slowest)
    ranks = runs[min(range(repeats), key=lambda k: abs(slowest[k] - median))][0]
    return {
        "case": case,
        "repeats": repeats,
        "ranks": ranks,
        "slowest_rank_s": median,
        "slowest_rank_s_runs": slowest,
        "wall_with_startup_s": statistics.median(wall for _, wall in runs),
        "rss_ok": all(r["rss"] <= r["held"] + RSS_SLACK for ranks, _ in runs for r in ranks),
    }


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``source/case`` -> median slowest-rank seconds relative to the same source's tp1."""
    tp1 = {r["source"]: r["slowest_rank_s"] for r in rows if r["case"] == "tp1"}
    return {
        f"{r['source']}/{r['case']}": round(r["slowest_rank_s"] / tp1[r["source"]], 3)
        for r in rows
        if r["case"] != "tp1" and tp1.get(r["source"])
    }


def _head_rank(rank: int, world: int, rows: int, port: int, out: Any) -> None:
    """One rank of ``--head-step``: what ``engine/parallel/vocab.py`` does per step."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    vocab, hidden = 49152, 576
    g = torch.Generator().manual_seed(0)
    full = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    part = full.chunk(world)[rank].contiguous()
    picked = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    replicated, split = [], []
    for _ in range(60):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            F.linear(picked, full)
        replicated.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        box = [picked if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        local = F.linear(box[0], part).contiguous()
        parts = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
        dist.gather(local, parts, dst=0)
        if parts is not None:
            torch.cat(parts, -1)
        split.append(time.perf_counter() - t)
    if rank == 0:
        out.put((statistics.median(replicated[10:]), statistics.median(split[10:])))
    dist.destroy_process_group()


def head_step(repeats: int) -> list[dict[str, Any]]:
    """``--head-step``: per-step head time, replicated vs vocab-split (medians of runs)."""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows_out = []
    for world in (2, 3):
        for rows in (1, 8):
            runs = []
            for _ in range(repeats):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                out = ctx.SimpleQueue()
                procs = [
                    ctx.Process(target=_head_rank, args=(r, world, rows, port, out))
                    for r in range(world)
                ]
                for proc in procs:
                    proc.start()
                for proc in procs:
                    proc.join()
                runs.append(out.get())
            row = {
                "ranks": world,
                "rows": rows,
                "replicated_ms": statistics.median(r[0] for r in runs) * 1e3,
                "split_ms": statistics.median(r[1] for r in runs) * 1e3,
            }
            rows_out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows_out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, uri, options, gap = sys.argv[2:7]
        worker(int(rank), int(world), uri, json.loads(options), None if gap == "none" else 0)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=15, help="15: ~1.5 GiB")
    ap.add_argument("--hidden", type=int, default=2048, help="smaller for a quick check")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--cases", default=",".join(CASES), help="a subset of the cases")
    ap.add_argument("--out", help="keep the model here (default: a temporary directory)")
    ap.add_argument("--head-step", action="store_true", help="time the vocab-split head only")
    args = ap.parse_args()
    if args.head_step:
        rows = head_step(args.repeats)
        print(json.dumps({"load_avg_1m": os.getloadavg()[0], "rows": rows}, indent=1))
        return
    directory = Path(args.out or tempfile.mkdtemp(prefix="tp-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    total = write_model(directory, args.layers, args.hidden)
    print(f"model: {total / 2**30:.2f} GiB, {args.layers} layers, in {directory}", file=sys.stderr)
    rows = []
    for source in args.sources.split(","):
        server: Any = None
        options: dict[str, Any] = {}
        if source == "local":
            pass
        elif source in ("http", "http-slow"):
            from bench.servers import NginxBenchSource, SlowNginxBenchSource

            server = NginxBenchSource() if source == "http" else SlowNginxBenchSource()
            server.start(directory)
        elif source == "s3":
            import boto3

            from bench.servers import SeaweedBenchSource

            server = SeaweedBenchSource()
            server.start(directory)
            options = dict(server.locate(directory, "model.tensors").options)
            boto3.client(
                "s3",
                endpoint_url=options["endpoint"],
                aws_access_key_id=options["access_key"],
                aws_secret_access_key=options["secret_key"],
                region_name=options["region"],
            ).upload_file(str(directory / "tensor-parallel.json"), "bench", "tensor-parallel.json")
        else:
            raise SystemExit(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")

        def uri_of(name: str, server: Any = server) -> str:
            return str(directory / name) if server is None else server.locate(directory, name).uri

        try:
            chosen = [c for c in args.cases.split(",") if c in CASES]
            for case in [c for c in chosen if source != "http-slow" or c in SLOW_CASES]:
                row = run_case(case, uri_of, options, args.repeats)
                row["source"] = source
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            if server is not None:
                server.stop()
    summary = {
        "model_bytes": total,
        "layers": args.layers,
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "ratio_to_tp1": _ratios(rows),
        "rows": rows,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
