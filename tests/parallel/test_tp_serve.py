"""``tensorstream serve MODEL -tp 3``: three ranks serve the unsharded model's greedy text,
and SIGTERM stops the server together with its rank processes."""

from __future__ import annotations

import os
import time

from serveproc import ServeProcess

from tensorstream import LLM, SamplingParams

PROMPT = "The capital of France is"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # exited between the two checks
        return False


def _survivors(pids: list[int], within: float) -> list[str]:
    """Command lines of ``pids`` still alive after ``within`` seconds (orphans exit on EOF
    of their parent's pipes a moment after it, so give them a bounded grace period)."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = []
    for pid in alive:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {command}")
        except OSError:
            continue
    return out


def test_serve_tp3_matches_unsharded_and_stops_its_ranks(smollm2_dir, tmp_path):
    llm = LLM(str(smollm2_dir), cpu_threads=1)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    args = [str(smollm2_dir), "-tp", "3", "--cpu-threads", "1", "--served-model-name", "smol"]
    server = ServeProcess.start(args, tmp_path / "serve.log")
    try:
        status, body = server.request(
            "POST",
            "/v1/completions",
            {"model": "smol", "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
            timeout=120,
        )
        assert status == 200, body
        assert body["choices"][0]["text"] == want
        ranks = [
            int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == server.proc.pid
        ]
        assert len(ranks) >= 2  # ranks 1 and 2 are the server's children
        assert server.terminate() == 0
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "tensor parallel x3" in log and "rank 2:" in log
    assert "Traceback" not in log
    assert not _survivors(ranks, within=15.0)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[1])
    except (OSError, ValueError):
        return -1
