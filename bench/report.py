"""Turn result rows into medians, ratios, markdown tables, a PNG plot and ``benchmarks.md``.

Speeds are decimal GB/s (1e9 bytes per second) of checkpoint tensor bytes over the timed
region. "vs best peer" divides a row's median by the best median among the real peers
(``bench.cases.PEERS``) for the same operation, source and cache state, so tensorstream and
the raw references are read against the strongest alternative measured in the same run.
Every successful row carries a checksum of the bytes it ended with; all rows of a run must
agree, and any disagreement is listed at the top of the report.

``write_docs`` rewrites only the text between the generated-section markers of
``benchmarks.md``; the hand-written prose around them stays.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path

from bench.cases import PEERS

__all__ = [
    "BEGIN",
    "END",
    "machine_info",
    "render_markdown",
    "summarize",
    "write_docs",
    "write_plot",
]

BEGIN = "<!-- BEGIN GENERATED: bench results (python -m bench.run --out docs/) -->"
END = "<!-- END GENERATED: bench results -->"
PLOT_NAME = "bench-local.png"
_CACHE_ORDER = {"warm": 0, "cold": 1, "none": 2}
_SOURCE_ORDER = {"local": 0, "http": 1, "s3": 2}
_OP_ORDER = {"load": 0, "touch": 1, "serialize": 2}


def machine_info() -> dict:
    """CPU count, RAM, kernel, Python, torch and peer versions of this machine."""
    import importlib.metadata as md

    info = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
    }
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    for pkg in ("torch", "tensorizer", "safetensors", "runai-model-streamer", "tensorstream"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict]) -> dict:
    """Group rows by (op, source, cache, case) and compute medians, ranges and ratios.

    Args:
        rows: result rows as workers print them (plus ``repeat``).

    Returns:
        ``{"groups": [...], "mismatches": [...]}``. Each group has case, peer, op, source,
        cache, runs, ok, median/min/max ``gbps``, median ``seconds``, max ``peak_rss_mib``,
        medians of the phase timings, ``vs_best_peer`` and, if no run succeeded, ``reason``.
    """
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_key[(r["op"], r["source"], r["cache"], r["case"])].append(r)
    groups = []
    for (op, source, cache, case), rs in by_key.items():
        ok = [r for r in rs if r["status"] == "ok"]
        g = {"case": case, "peer": rs[0]["peer"], "op": op, "source": source, "cache": cache,
             "runs": len(rs), "ok": len(ok)}  # fmt: skip
        if ok:
            speeds = [r["gbps"] for r in ok]
            g.update(gbps=_median(speeds), gbps_min=min(speeds), gbps_max=max(speeds),
                     seconds=_median([r["seconds"] for r in ok]),
                     peak_rss_mib=max(r["peak_rss_mib"] for r in ok),
                     rss_growth_mib=max(r["peak_rss_mib"] - r["rss_before_mib"] for r in ok),
                     file=ok[0].get("file", ""),
                     bytes=ok[0]["bytes"], checksum=ok[0]["checksum"])  # fmt: skip
            for k in ("load_seconds", "touch_seconds", "close_seconds", "fsync_seconds"):
                if k in ok[0]:
                    g[k] = _median([r[k] for r in ok])
        bad = [r for r in rs if r["status"] != "ok"]
        if bad:
            g["status"] = bad[0]["status"]
            g["reason"] = bad[0].get("reason", "")
        groups.append(g)
    best: dict[tuple, float] = {}
    for g in groups:
        if g["peer"] in PEERS and g.get("gbps"):
            k = (g["op"], g["source"], g["cache"])
            best[k] = max(best.get(k, 0.0), g["gbps"])
    for g in groups:
        b = best.get((g["op"], g["source"], g["cache"]))
        g["vs_best_peer"] = g["gbps"] / b if b and g.get("gbps") else None
    groups.sort(key=lambda g: (_OP_ORDER.get(g["op"], 9), _SOURCE_ORDER.get(g["source"], 9),
                               g["source"], _CACHE_ORDER.get(g["cache"], 9)))  # fmt: skip
    return {"groups": groups, "mismatches": _mismatches(rows)}


def _mismatches(rows: list[dict]) -> list[str]:
    seen: dict[tuple, set[str]] = defaultdict(set)
    for r in rows:
        if r["status"] == "ok":
            seen[(r["bytes"], r["checksum"])].add(r["case"])
    if len(seen) <= 1:
        return []
    return [
        f"{n} bytes, checksum {c}: {', '.join(sorted(cases))}" for (n, c), cases in seen.items()
    ]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _load_table(groups: list[dict]) -> list[str]:
    lines = ["| case | peer | median GB/s | min–max | vs best peer | load s | touch s "
             "| peak RSS MiB | RSS growth MiB | file |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for g in sorted(groups, key=lambda g: -(g.get("gbps") or 0)):
        if not g["ok"]:
            lines.append(f"| {g['case']} | {g['peer']} | {g['status']} | | | | | | | |")
            continue
        ratio = f"{g['vs_best_peer']:.2f}×" if g["vs_best_peer"] else "–"
        lines.append(
            f"| {g['case']} | {g['peer']} | {g['gbps']:.2f} | {g['gbps_min']:.2f}–{g['gbps_max']:.2f}"
            f" | {ratio} | {_fmt(g.get('load_seconds'), '.3f')} | {_fmt(g.get('touch_seconds'), '.3f')}"
            f" | {g['peak_rss_mib']:.0f} | {g['rss_growth_mib']:.0f} | {g['file']} |"
        )
    return lines


def _serialize_table(groups: list[dict]) -> list[str]:
    lines = ["| case | until close() s | fsync after s | durable GB/s | min–max | peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for g in sorted(groups, key=lambda g: -(g.get("gbps") or 0)):
        if not g["ok"]:
            lines.append(f"| {g['case']} | {g['status']} | | | | |")
            continue
        lines.append(
            f"| {g['case']} | {g['close_seconds']:.3f} | {g['fsync_seconds']:.3f} | {g['gbps']:.2f}"
            f" | {g['gbps_min']:.2f}–{g['gbps_max']:.2f} | {g['peak_rss_mib']:.0f} |"
        )
    return lines


def render_markdown(summary: dict, meta: dict) -> str:
    """The results section as markdown: machine, tables per source and cache, caveats.

    Args:
        summary: from ``summarize``.
        meta: run metadata (``bench.run``): started, size_mib, repeats, machine, checkpoint.

    Returns:
        Markdown text (also what ``bench.run`` prints).
    """
    m = meta.get("machine", {})
    ck = meta.get("checkpoint", {})
    spec = ck.get("spec", {})
    out = [
        f"Run {meta.get('started', '?')}: {m.get('cpus')} CPUs ({m.get('cpu_model')}), "
        f"{m.get('ram_gib')} GiB RAM, Linux {m.get('kernel')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}, tensorizer {m.get('tensorizer')}, safetensors {m.get('safetensors')}, "
        f"tensorstream {m.get('tensorstream')}.",
        "",
        f"Checkpoint: {ck.get('nbytes', 0) / 2**20:.0f} MiB bf16, {ck.get('tensors')} tensors "
        f"(hidden {spec.get('hidden')}, intermediate {spec.get('intermediate')}, vocab "
        f"{spec.get('vocab')}, {spec.get('layers')} layers). Median of {meta.get('repeats')} runs, "
        "each in a fresh process; GB/s = 1e9 bytes/s over load + one pass over every byte. "
        "*vs best peer* divides by the fastest of tensorizer / safetensors / runai in the same "
        "table. *RSS growth* is peak RSS minus the peak before the timed region (setup, such as "
        "the pre-touched buffers of `readinto-touched`, is not in it).",
        "",
    ]
    groups = summary["groups"]
    if summary["mismatches"]:
        out += (
            ["**Loaders disagree on the bytes:**", ""]
            + [f"- {x}" for x in summary["mismatches"]]
            + [""]
        )
    else:
        n_ok = sum(1 for g in groups if g["ok"])
        out += [f"All {n_ok} cases that ran returned identical bytes (same checksum).", ""]
    sections = defaultdict(list)
    for g in groups:
        sections[(g["op"], g["source"], g["cache"])].append(g)
    for (op, source, cache), gs in sections.items():
        if op == "load":
            out += [f"### Load from {source}, {cache} page cache", ""] + _load_table(gs) + [""]
        elif op == "serialize":
            out += [f"### Serialize to {source} disk", "",
                    "Tensors are resident before timing. *until close()* is what the writer's "
                    "`close()` takes; the harness then fsyncs the file (*fsync after* is near zero "
                    "when the writer already made it durable; tensorizer 2.12.1 does not fsync), "
                    "and *durable GB/s* counts both.", ""]  # fmt: skip
            out += _serialize_table(gs) + [""]
        elif op == "touch":
            for g in gs:
                if g["ok"]:
                    out += [f"The touch pass alone on resident memory (`{g['case']}`): "
                            f"{g['gbps']:.1f} GB/s median — the ceiling every load number above "
                            "is measured against.", ""]  # fmt: skip
    missing = [g for g in groups if g.get("status")]
    if missing:
        out += ["Cases that did not run everywhere:", ""]
        out += [f"- `{g['case']}` ({g['cache']}): {g['status']} in {g['runs'] - g['ok']}/{g['runs']} runs — "
                f"{g['reason'][:200]}" for g in missing]  # fmt: skip
        out.append("")
    return "\n".join(out)


def write_plot(summary: dict, path: Path, source: str = "local") -> Path | None:
    """Bar chart of median load GB/s (min–max whiskers), warm and cold side by side.

    Args:
        summary: from ``summarize``.
        path: PNG to write.
        source: which source's load cases to plot.

    Returns:
        The path, or None when no load case of that source succeeded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gs = [g for g in summary["groups"] if g["op"] == "load" and g["source"] == source and g["ok"]]
    if not gs:
        return None
    caches = [c for c in ("warm", "cold") if any(g["cache"] == c for g in gs)]
    rows = max(sum(1 for g in gs if g["cache"] == c) for c in caches)
    fig, axes = plt.subplots(1, len(caches), figsize=(6.5 * len(caches), 0.32 * rows + 1.6),
                             squeeze=False)  # fmt: skip
    colors = {"tensorstream": "#1b9e77", "tensorizer": "#d95f02", "safetensors": "#7570b3",
              "runai": "#e7298a", "reference": "#999999"}  # fmt: skip
    for ax, cache in zip(axes[0], caches, strict=True):
        sel = sorted((g for g in gs if g["cache"] == cache), key=lambda g: g["gbps"])
        ys = range(len(sel))
        meds = [g["gbps"] for g in sel]
        err = [[g["gbps"] - g["gbps_min"] for g in sel], [g["gbps_max"] - g["gbps"] for g in sel]]
        ax.barh(
            list(ys), meds, xerr=err, color=[colors.get(g["peer"], "#666") for g in sel], capsize=2
        )
        ax.set_yticks(list(ys), [g["case"] for g in sel], fontsize=8)
        for y, g in zip(ys, sel, strict=True):
            ax.text(g["gbps_max"], y, f"  {g['gbps']:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, max(g["gbps_max"] for g in sel) * 1.15)
        ax.set_xlabel("GB/s (median, min–max)")
        ax.set_title(f"load from {source}, {cache} page cache")
    peers = sorted({g["peer"] for g in gs})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors.get(p, "#666")) for p in peers]
    axes[0][-1].legend(handles, peers, loc="lower right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_TEMPLATE = """# Benchmarks

`make bench` (`python -m bench.run`) builds a synthetic ~1.5 GiB bf16 Llama-shaped checkpoint
once, in every format a case needs, and measures tensorstream beside its peers in the same
run. `python -m bench.run --quick` is a 256 MiB, 3-repeat version; `--list` shows the cases.

{begin}
{end}
"""


def write_docs(summary: dict, meta: dict, out_dir: Path) -> list[Path]:
    """Write the PNG and replace the generated section of ``out_dir/benchmarks.md``.

    Args:
        summary: from ``summarize``.
        meta: run metadata.
        out_dir: docs directory; ``benchmarks.md`` is created from a template if missing.

    Returns:
        Paths written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    body = render_markdown(summary, meta)
    for source in ("local", "http", "s3"):
        name = PLOT_NAME if source == "local" else f"bench-{source}.png"
        plot = write_plot(summary, out_dir / name, source)
        if plot:
            written.append(plot)
            body += f"\n![load throughput from {source}]({name})\n"
    md = out_dir / "benchmarks.md"
    text = md.read_text() if md.exists() else _TEMPLATE.format(begin=BEGIN, end=END)
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    md.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    written.append(md)
    return written
