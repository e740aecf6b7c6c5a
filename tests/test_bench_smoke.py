"""The bench harness end to end on a ~8 MiB checkpoint: rows well-formed, loaders agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402
from bench.cases import CASES, Case, select  # noqa: E402
from bench.checkpoint import CheckpointSpec, make_state_dict, tensor_shapes  # noqa: E402
from bench.run import main  # noqa: E402
from bench.touch import touch_all  # noqa: E402

LOADERS = ["tensorizer-r1", "tensorizer-default-verify", "safetensors-load_file", "readinto-fresh",
           "readinto-touched", "tensorstream-r2", "tensorstream-r4-tzfile",
           "tensorstream-r4-tzfile-noarena", "tensorstream-r4-verify-crc32"]  # fmt: skip
OTHERS = ["touch-resident", "serialize-tensorizer", "serialize-tensorstream"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    out_json = tmp / "results.json"
    argv = ["--size-mib", "8", "--repeats", "1", "--cache", "warm", "--cache-dir", str(tmp / "cache"),
            "--cases", ",".join(LOADERS + OTHERS), "--results", str(out_json), "--out", str(tmp / "docs")]  # fmt: skip
    status = main(argv)
    assert status == 0, "loaders disagreed on the bytes"
    return json.loads(out_json.read_text()), tmp


def test_spec_sizes_are_llama_shaped_and_near_target() -> None:
    for mib in (8, 64, 1536):
        spec = CheckpointSpec.for_size(mib)
        assert abs(spec.nbytes / 2**20 - mib) / mib < 0.15
        names = tensor_shapes(spec)
        assert "model.layers.0.self_attn.q_proj.weight" in names
        assert "lm_head.weight" in names and "model.norm.weight" in names
    full = CheckpointSpec.for_size(1536)
    assert (full.hidden, full.intermediate, full.vocab, full.kv_dim) == (2048, 5632, 32000, 256)


def test_state_dict_is_deterministic_and_checksum_sees_every_byte() -> None:
    spec = CheckpointSpec.for_size(1)
    a, b = make_state_dict(spec), make_state_dict(spec)
    assert touch_all(a.items()).checksum == touch_all(b.items()).checksum
    name = "model.layers.0.mlp.up_proj.weight"
    before = touch_all(a.items())
    a[name].view(-1)[-1] += 1  # the last element of one tensor
    after = touch_all(a.items())
    assert after.bytes == before.bytes == spec.nbytes
    assert after.checksum != before.checksum


def test_checksum_does_not_depend_on_where_a_tensor_starts() -> None:
    """The same bytes at any address (views of tensorizer's file start at 2-byte offsets)
    give the words of an aligned, zero-padded copy, also across the scratch buffer's
    pieces; a changed byte in a later piece changes the sum."""
    import torch
    from bench.touch import _word_sum

    def padded_copy_sum(raw: torch.Tensor) -> int:
        padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8)
        padded[: raw.numel()] = raw
        return int(padded.view(torch.int64).sum()) & (2**64 - 1)

    g = torch.Generator().manual_seed(5)
    backing = torch.randint(0, 256, (3 * 2**20 + 64,), dtype=torch.uint8, generator=g)
    for offset in (0, 1, 2, 6, 8):
        for n in (1, 7, 8, 13, 2**20, 2**20 + 6, 3 * 2**20 + 3):
            raw = backing[offset : offset + n]
            total, nbytes, copied = _word_sum(raw)
            assert (total, nbytes) == (padded_copy_sum(raw), n), (offset, n)
            assert copied == bool(offset % 8 or n % 8)
    shifted = torch.cat([torch.zeros(2, dtype=torch.uint8), backing[: 2**21]])[2:]
    assert shifted.data_ptr() % 8
    before = _word_sum(shifted)[0]
    shifted[2**20 + 5] += 1
    assert _word_sum(shifted)[0] != before


def test_rows_are_well_formed(results: tuple[dict, Path]) -> None:
    data, _ = results
    rows = data["rows"]
    assert {r["case"] for r in rows} == set(LOADERS + OTHERS)
    for r in rows:
        assert r["status"] in ("ok", "unavailable", "error"), r
        assert r["status"] != "error", r
        if r["status"] == "ok":
            assert r["seconds"] > 0 and r["gbps"] > 0 and r["peak_rss_mib"] > 0
            assert len(r["checksum"]) == 16
        else:
            assert r["reason"]
    ok = {r["case"] for r in rows if r["status"] == "ok"}
    # Peers and references must run here; only tensorstream's own cases may be missing.
    assert ok >= set(LOADERS + OTHERS) - {"tensorstream-r2", "serialize-tensorstream"}


def test_every_loader_returned_the_same_bytes(results: tuple[dict, Path]) -> None:
    data, _ = results
    ok = [r for r in data["rows"] if r["status"] == "ok"]
    nbytes = data["meta"]["checkpoint"]["nbytes"]
    assert {r["bytes"] for r in ok} == {nbytes}
    assert len({r["checksum"] for r in ok}) == 1
    assert {r["tensors"] for r in ok} == {data["meta"]["checkpoint"]["tensors"]}


def test_report_and_docs_written(results: tuple[dict, Path]) -> None:
    data, tmp = results
    md = (tmp / "docs" / "benchmarks.md").read_text()
    assert report.BEGIN in md and report.END in md
    assert "| safetensors-load_file | safetensors |" in md
    png = tmp / "docs" / report.PLOT_NAME
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Regenerating keeps the prose outside the markers.
    (tmp / "docs" / "benchmarks.md").write_text("intro prose\n\n" + md + "\nclosing prose\n")
    report.write_docs(report.summarize(data["rows"]), data["meta"], tmp / "docs")
    again = (tmp / "docs" / "benchmarks.md").read_text()
    assert again.startswith("intro prose") and again.rstrip().endswith("closing prose")
    assert again.count(report.BEGIN) == 1


def test_mismatched_checksums_are_reported() -> None:
    base = {"peer": "tensorizer", "op": "load", "source": "local", "cache": "warm", "status": "ok",
            "seconds": 1.0, "gbps": 1.0, "peak_rss_mib": 1.0, "rss_before_mib": 1.0, "bytes": 8}  # fmt: skip
    rows = [
        {**base, "case": "a", "checksum": "0" * 16},
        {**base, "case": "b", "checksum": "1" * 16},
    ]
    assert len(report.summarize(rows)["mismatches"]) == 2


def test_registry_rejects_duplicates_and_unknown_patterns() -> None:
    with pytest.raises(ValueError):
        select(["no-such-case-*"])
    with pytest.raises(ValueError):
        from bench.cases import register

        register(Case("tensorizer-r1", "tensorizer", "load", "tensorizer_load", "tensorizer"))
    assert "readinto-touched" in CASES


def test_cold_cache_runs_or_says_why(results: tuple[dict, Path]) -> None:
    _, tmp = results
    out_json = tmp / "cold.json"
    argv = ["--size-mib", "8", "--repeats", "1", "--cache", "cold", "--cache-dir", str(tmp / "cache"),
            "--cases", "readinto-fresh", "--results", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["cache"] == "cold"
    assert row["status"] == "ok" or (
        row["status"] == "unavailable" and "page cache" in row["reason"]
    )


@pytest.mark.integration
def test_http_and_s3_sources_agree_with_local(results: tuple[dict, Path]) -> None:
    data, tmp = results
    out_json = tmp / "remote.json"
    cases = ["tensorizer-http-r4", "urllib3-http-t4", "tensorizer-s3-default", "runai-s3", "boto3-s3-t8",
             "tensorstream-http-r4", "tensorstream-s3-r4", "socket-http-t4-fresh"]  # fmt: skip
    argv = ["--size-mib", "8", "--repeats", "1", "--cache", "warm", "--cache-dir", str(tmp / "cache"),
            "--sources", "http,s3", "--cases", ",".join(cases), "--results", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["source"] for r in rows} == {"http", "s3"}
    local = {r["checksum"] for r in data["rows"] if r["status"] == "ok"}
    for r in rows:
        if r["peer"] == "tensorstream" and r["status"] == "unavailable":
            continue  # tensorstream's remote loader may not be built yet
        assert r["status"] == "ok", r
        assert r["checksum"] in local, r


def test_serve_bench_vllm_peer_needs_its_venv_and_says_how(tmp_path: Path) -> None:
    from bench.serve_bench import error_line
    from bench.serve_bench import main as serve_main

    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(SystemExit) as exc:
        serve_main(["--peer", "vllm", "--vllm-python", str(missing)])
    assert str(missing) in str(exc.value) and "scripts/vllm-peer.sh" in str(exc.value)
    log = tmp_path / "server.log"
    log.write_text(
        "WARNING 12-02 [x.py:1] errors like `OSError: [Errno 24] Too many open files`\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
        "  Value error, To load a model from object storage (S3/GCS/Azure), 'load_format' must"
        " be 'runai_streamer', but got 'tensorizer'.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert error_line(log).startswith("Value error, To load a model from object storage")


def test_encrypted_bench_runs_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``bench.cases_crypto`` on 16 MiB: every case reports a positive median, the plot is
    written, and a saved output re-plots without running anything."""
    from bench import cases_crypto

    png = tmp_path / "crypto.png"
    assert cases_crypto.main(["--size-mib", "16", "--repeats", "1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {r["case"] for r in rows} == set(cases_crypto._ORDER)  # noqa: SLF001
    assert all(r["mib"] == 16 and r["GB/s"] > 0 for r in rows)
    assert "save ours/tensorizer" in out
    assert png.stat().st_size > 10_000
    saved = tmp_path / "out.txt"
    saved.write_text(out)
    replot = tmp_path / "again.png"
    assert cases_crypto.main(["--from-lines", str(saved), "--plot", str(replot)]) == 0
    assert replot.stat().st_size > 10_000


def test_decode_profile_compares_the_lean_pass() -> None:
    """``bench.decode_profile --compare-lean`` on the built-in model: both paths timed."""
    import re
    import subprocess

    argv = [sys.executable, "-m", "bench.decode_profile", "--batch", "2", "--steps", "6",
            "--dtype", "float32", "--same-prompt", "--compare-lean"]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    step = re.search(r"batch   2: step +([\d.]+) ms .* ([\d.]+) tok/s", done.stdout)
    assert step and float(step[1]) > 0 and float(step[2]) > 0, done.stdout
    pair = re.search(r"lean pass +([\d.]+) ms, modules +([\d.]+) ms per step \(([\d.]+)x\)",
                     done.stdout)  # fmt: skip
    assert pair and float(pair[1]) > 0 and float(pair[2]) > 0, done.stdout
    assert abs(float(pair[2]) / float(pair[1]) - float(pair[3])) < 0.01


def test_serve_bench_rounds_alternate_and_freeze_the_idle_server(
    tmp_path: Path, monkeypatch
) -> None:
    """``bench.serve_bench --rounds``: rounds alternate the order, the server not measured is
    stopped (SIGSTOP, state T), medians per level; a frozen server still stops cleanly."""
    import argparse
    import time

    from bench import serve_bench

    code = "import time\nwhile True: time.sleep(0.01)"
    servers = {name: serve_bench.Server([sys.executable, "-c", code], {}, tmp_path / f"{name}.log")
               for name in ("tensorstream", "vllm")}  # fmt: skip
    order: list[tuple[str, bool]] = []
    speeds = {"tensorstream": iter([30.0, 10.0, 20.0]), "vllm": iter([5.0, 7.0, 6.0])}

    def frozen(server: serve_bench.Server) -> bool:
        for _ in range(100):  # SIGSTOP lands asynchronously
            stat = Path(f"/proc/{server.proc.pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return True
            time.sleep(0.01)
        return False

    def fake_levels(server, levels, requests, max_tokens):
        name = next(n for n, s in servers.items() if s is server)
        other = next(s for n, s in servers.items() if s is not server)
        order.append((name, frozen(other)))
        tok = next(speeds[name])
        return [{"clients": c, "requests": 2, "tokens_per_s": tok * c, "p50_s": 1.0 / tok,
                 "p99_s": 2.0 / tok} for c in levels]  # fmt: skip

    monkeypatch.setattr(serve_bench, "load_levels", fake_levels)
    args = argparse.Namespace(rounds=3, levels=[1, 4], requests=2, max_tokens=8)
    try:
        out = serve_bench.interleaved_rounds(servers, args)
        assert [name for name, _ in order] == ["tensorstream", "vllm", "vllm", "tensorstream",
                                               "tensorstream", "vllm"]  # fmt: skip
        assert all(other_frozen for _, other_frozen in order)  # the idle one frozen
        assert all(frozen(s) for s in servers.values())  # both frozen after the rounds
        ours = out["tensorstream"]["load"]
        assert [row["tokens_per_s"] for row in ours] == [20.0, 80.0]  # medians of 30, 10, 20
        assert ours[1]["tokens_per_s_range"] == [40.0, 120.0]
        assert len(out["vllm"]["rounds"]) == 3 and out["vllm"]["load"][0]["tokens_per_s"] == 6.0
    finally:
        for server in servers.values():
            server.stop()
    assert all(s.proc.poll() is not None for s in servers.values())  # stopped though frozen
