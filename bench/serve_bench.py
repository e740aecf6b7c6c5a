"""``python -m bench.serve_bench``: how fast ``tensorstream serve`` starts and how well it batches.

Measures, with the built-in model (SmolLM2-135M) tensorized once into a temp dir:

* **cold start**: from launching ``tensorstream serve`` to the first answered
  completion, serving the tensorized directory from local disk and from S3
  (a SeaweedFS ``weed mini`` on loopback, the guide's ``s3://my-bucket/...`` command);
* **throughput and latency**: completion tokens/s and p50/p99 request latency with
  1, 4 and 16 concurrent clients (each sends ``--requests`` non-streamed greedy
  completions of exactly ``--max-tokens`` tokens, ``ignore_eos``).

Prints a Markdown table and, with ``--json PATH``, writes the raw figures.
Loopback S3 measures client cost, not a network. On a shared machine, read
ratios rather than absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
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

__all__ = ["main"]

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
PROMPT = "Write a short story about a robot who learns to paint."


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


class Server:
    """A ``tensorstream serve`` child process."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tensorstream", "serve", *args, "--port", str(self.port)]
        self.started = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )
        self.log = log

    def first_answer(self, model: str, timeout: float = 600.0) -> float:
        """Seconds from launch to the first answered completion (polled while loading)."""
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log}")
            status, _ = _post(self.url + "/v1/completions", body, timeout=60)
            if status == 200:
                return time.perf_counter() - self.started
            time.sleep(0.02)
        raise RuntimeError(f"server not ready in {timeout}s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _load(server: Server, model: str, clients: int, requests: int, max_tokens: int) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 cold start")
    parser.add_argument("--json", default=None, help="write the raw figures here")
    parser.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    args = parser.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"max_tokens": args.max_tokens, "requests_per_client": args.requests}
    model_dir = work / "tensorized"
    if not (model_dir / "model.tensors").is_file():
        _tensorize_builtin(model_dir)
    results["model_bytes"] = (model_dir / "model.tensors").stat().st_size

    # Cold start from S3 (the guide's command), then from the local dir (kept for the load test).
    if not args.no_s3:
        from tests.servers.seaweed import S3Server

        s3 = S3Server.start(work / "weed")
        try:
            client = s3.client()
            client.create_bucket(Bucket="my-bucket")
            prefix = "vllm/facebook/opt-125m/v1"
            for path in sorted(model_dir.iterdir()):
                client.upload_file(str(path), "my-bucket", f"{prefix}/{path.name}")
            uri = f"s3://my-bucket/{prefix}"
            env = {
                "S3_ENDPOINT_URL": s3.endpoint,
                "S3_ACCESS_KEY_ID": s3.access_key,
                "S3_SECRET_ACCESS_KEY": s3.secret_key,
            }
            extra = '{"deserialization_kwargs": {"num_readers": 2}}'
            server = Server(
                [uri, "--load-format", "tensorizer", "--enable-lora"]
                + ["--model-loader-extra-config", extra],
                env,
                work / "serve-s3.log",
            )
            try:
                results["start_to_first_answer_s3_s"] = server.first_answer(uri)
            finally:
                server.stop()
        finally:
            s3.stop()

    server = Server(
        [str(model_dir), "--load-format", "tensorizer", "--served-model-name", "bench"],
        {},
        work / "serve-local.log",
    )
    try:
        results["start_to_first_answer_local_s"] = server.first_answer("bench")
        # Warm up (first forwards of each shape are slow), so level 1 is not charged for it.
        _load(server, "bench", 4, 1, args.max_tokens)
        results["load"] = []
        for clients in (int(c) for c in args.clients.split(",")):
            row = _load(server, "bench", clients, args.requests, args.max_tokens)
            results["load"].append(row)
            print(
                f"{clients:>3} clients: {row['tokens_per_s']:.1f} tok/s, "
                f"p50 {row['p50_s']:.2f} s, p99 {row['p99_s']:.2f} s",
                flush=True,
            )
    finally:
        server.stop()

    base = results["load"][0]["tokens_per_s"] if results["load"] else 0.0
    print()
    print(f"model: built-in SmolLM2-135M, {results['model_bytes'] / 1e6:.0f} MB tensorized")
    if "start_to_first_answer_s3_s" in results:
        print(f"start -> first answer, S3:    {results['start_to_first_answer_s3_s']:.2f} s")
    print(f"start -> first answer, local: {results['start_to_first_answer_local_s']:.2f} s")
    print()
    print("| clients | requests | completion tok/s | vs 1 client | p50 latency | p99 latency |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in results["load"]:
        ratio = row["tokens_per_s"] / base if base else float("nan")
        print(
            f"| {row['clients']} | {row['requests']} | {row['tokens_per_s']:.1f} | "
            f"{ratio:.1f}x | {row['p50_s']:.2f} s | {row['p99_s']:.2f} s |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
