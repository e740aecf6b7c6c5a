"""``python -m bench.run``: build the checkpoint, run every case in fresh processes, report.

Defaults are the full run (1.5 GiB checkpoint, 5 repeats, all cases, warm and cold page
cache); ``--quick`` is 256 MiB and 3 repeats. Repeats are interleaved (repeat 1 of every
case, then repeat 2 …) so slow drift on a shared machine spreads over all cases instead of
landing on one. Raw results go to ``<cache-dir>/results/<time>.json``; ``--out docs/``
also rewrites the generated sections of ``docs/benchmarks.md`` and the PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import report
from bench.cases import Case, select
from bench.checkpoint import FORMAT_FILES, CheckpointSpec, checkpoint_dir, ensure_checkpoint
from bench.sources import SOURCES, BenchSource, open_source
from bench.workers import RESULT_PREFIX, Unavailable, drop_page_cache

__all__ = ["main", "run_case"]

REPO = Path(__file__).resolve().parent.parent


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=None, help="checkpoint size (default 1536)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per case and cache state (default 5)"
    )
    ap.add_argument("--quick", action="store_true", help="256 MiB, 3 repeats unless given")
    ap.add_argument("--cases", default="", help="comma-separated globs of case names (default all)")
    ap.add_argument("--sources", default="all", help="comma-separated: local,http,s3 (default all)")
    ap.add_argument("--cache", default="warm,cold", help="page-cache states to run: warm,cold")
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".bench", help="checkpoint cache dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per worker process")
    ap.add_argument(
        "--out", type=Path, default=None, help="write benchmarks.md + PNG into this dir"
    )
    ap.add_argument("--results", type=Path, default=None, help="also write raw results JSON here")
    ap.add_argument("--rebuild", action="store_true", help="rewrite the cached checkpoint files")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--from-results", type=Path, default=None,
                    help="re-render the report (and --out docs) from a saved results JSON; runs nothing")  # fmt: skip
    args = ap.parse_args(argv)
    args.size_mib = args.size_mib or (256 if args.quick else 1536)
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def run_case(spec: dict, env: dict[str, str], timeout: float) -> dict:
    """Run one measurement in a fresh ``python -m bench.workers`` process.

    Args:
        spec: the worker spec (case fields, located file, cache state, params).
        env: extra environment variables for the child.
        timeout: seconds before the child is killed.

    Returns:
        The worker's result row; status ``error`` if it crashed, timed out or printed none.
    """
    head = {k: spec[k] for k in ("case", "peer", "op", "source", "cache")}
    cmd = [sys.executable, "-m", "bench.workers", json.dumps(spec)]
    child_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        done = subprocess.run(
            cmd, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**head, "status": "error", "reason": f"worker timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (done.stderr or done.stdout)[-2000:]
    return {
        **head,
        "status": "error",
        "reason": f"worker exited {done.returncode} without a result: {tail}",
    }


def _cold_check(caches: list[str]) -> str | None:
    if "cold" not in caches:
        return None
    try:
        drop_page_cache()
    except Unavailable as exc:
        return str(exc)
    return None


def _plan(cases: list[Case], caches: list[str]) -> list[tuple[Case, str]]:
    runs = []
    for case in cases:
        for cache in case.caches:
            if cache == "none" or cache in caches:
                runs.append((case, cache))
    return runs


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (1 if a loader's bytes disagree)."""
    args = _parse(argv)
    if args.from_results:
        saved = json.loads(args.from_results.read_text())
        return _report(saved["rows"], saved["meta"], args.out)
    wanted = list(SOURCES) if args.sources == "all" else args.sources.split(",")
    cases = select(args.cases.split(","), wanted)
    if args.list:
        for c in cases:
            print(
                f"{c.name:28} {c.peer:13} {c.op:10} {c.source:6} {','.join(c.caches):10} {c.note}"
            )
        return 0
    caches = [c for c in args.cache.split(",") if c]
    spec = CheckpointSpec.for_size(args.size_mib, args.seed)
    formats = sorted({f for c in cases for f in (c.fmt, c.fallback_fmt) if f} | {"safetensors"})
    print(
        f"checkpoint: {spec.slug} ({spec.nbytes / 2**20:.0f} MiB); formats {formats}",
        file=sys.stderr,
    )
    if args.rebuild:
        # A writer that changed since the files were cached must be measured on its new output.
        shutil.rmtree(checkpoint_dir(args.cache_dir, spec), ignore_errors=True)
    directory, manifest = ensure_checkpoint(args.cache_dir, spec, formats)
    scratch = args.cache_dir / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    cold_reason = _cold_check(caches)

    sources: dict[str, BenchSource] = {}
    rows: list[dict] = []
    started = time.time()
    try:
        source_errors: dict[str, str] = {}
        for name in sorted({c.source for c in cases}):
            try:
                src = open_source(name)
                src.start(directory)
                sources[name] = src
            except (
                Exception
            ) as exc:  # a missing server makes its cases unavailable, not the run fail
                source_errors[name] = f"source {name} did not start: {type(exc).__name__}: {exc}"
                print(source_errors[name][:400], file=sys.stderr)
        runs = _plan(cases, caches)
        for rep in range(args.repeats):
            for case, cache in runs:
                head = {"case": case.name, "peer": case.peer, "op": case.op, "source": case.source,
                        "cache": cache, "repeat": rep}  # fmt: skip
                fmt_name = case.fmt
                fmt = manifest["formats"].get(fmt_name, {})
                if fmt.get("status") != "ok" and case.fallback_fmt:
                    fmt_name = case.fallback_fmt
                    fmt = manifest["formats"].get(fmt_name, {})
                head["file"] = FORMAT_FILES[fmt_name]
                if fmt.get("status") != "ok":
                    row = {**head, "status": "unavailable",
                           "reason": f"no {case.fmt} checkpoint: {fmt.get('reason', 'not written')}"}  # fmt: skip
                elif case.source in source_errors:
                    row = {
                        **head,
                        "status": "unavailable",
                        "reason": source_errors[case.source][:600],
                    }
                elif cache == "cold" and cold_reason:
                    row = {**head, "status": "unavailable", "reason": cold_reason}
                else:
                    located = sources[case.source].locate(directory, FORMAT_FILES[fmt_name])
                    wspec = {**head, "worker": case.worker, "params": dict(case.params),
                             "located": {"uri": located.uri, "cache_paths": list(located.cache_paths),
                                         "options": dict(located.options)},
                             "scratch": str(scratch / f"{case.name}.out")}  # fmt: skip
                    row = {**run_case(wspec, dict(located.env), args.timeout), "repeat": rep,
                           "file": head["file"]}  # fmt: skip
                rows.append(row)
                _progress(row, rep, args.repeats)
    finally:
        for src in sources.values():
            src.stop()

    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_seconds": time.time() - started,
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        "checkpoint": manifest,
        "machine": report.machine_info(),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    results = {"meta": meta, "rows": rows}
    out_json = args.cache_dir / "results" / time.strftime("%Y%m%d-%H%M%S.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
    print(f"raw results: {out_json}", file=sys.stderr)
    return _report(rows, meta, args.out)


def _report(rows: list[dict], meta: dict, out: Path | None) -> int:
    summary = report.summarize(rows)
    print(report.render_markdown(summary, meta))
    if out:
        written = report.write_docs(summary, meta, out)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 1 if summary["mismatches"] else 0


def _progress(row: dict, rep: int, repeats: int) -> None:
    what = f"[{rep + 1}/{repeats}] {row['case']:26} {row['cache']:5}"
    if row["status"] == "ok":
        print(f"{what} {row['gbps']:7.2f} GB/s {row['seconds']:7.3f} s rss {row['peak_rss_mib']:7.0f} MiB",
              file=sys.stderr)  # fmt: skip
    else:
        print(f"{what} {row['status']}: {row.get('reason', '')[:160]}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
