"""The console's routes and ``/v1/load_stats`` in-process (no model, no browser): what is
open and what needs the key, ``--no-ui``, the static files shipped in the wheel, and the
timeline's bookkeeping."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tensorstream.engine.load_stats import LoadStats
from tensorstream.server.app import ServeOptions, ServerState, create_app
from tensorstream.server.console import STATIC_FILES
from tensorstream.server.timeline import StartupTimeline

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "src" / "tensorstream" / "server" / "console" / "static"
KEY = "k-123"


def get(app, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One GET through the whole ASGI app (middleware included); status, headers, body."""
    headers = [(b"host", b"test")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    names = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], names, body


def app_for(**options):
    return create_app(ServerState(ServeOptions(served_model_name="smol", **options)))


def test_console_is_served_while_loading_and_the_api_needs_the_key():
    app = app_for(api_key=KEY)
    status, headers, body = get(app, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'src="/console/main.js"' in body
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert get(app, "/console/main.js")[0] == 200
    assert json.loads(get(app, "/console/config.json")[2]) == {"auth": True}
    # Only the listed files: no path tricks, no other package files.
    for path in ("/console/__init__.py", "/console/..%2f__init__.py", "/console/static"):
        assert get(app, path)[0] == 404, path
    # The API stays closed without the key; with it, /v1/load_stats answers while loading.
    assert get(app, "/v1/models")[0] == 401
    assert get(app, "/v1/load_stats")[0] == 401
    assert get(app, "/v1/models", KEY)[0] == 503
    status, _, body = get(app, "/v1/load_stats", KEY)
    stats = json.loads(body)
    assert status == 200 and stats["status"] == "loading" and stats["ready_at"] is None
    assert stats["server"]["served_model_name"] == "smol"


def test_config_says_no_key_is_needed_without_one():
    assert json.loads(get(app_for(), "/console/config.json")[2]) == {"auth": False}


def test_no_ui_turns_the_console_off():
    state = ServerState(ServeOptions(served_model_name="smol", ui=False))
    app = create_app(state)
    state.mark_ready()
    assert get(app, "/")[0] == 404
    assert get(app, "/console/main.js")[0] == 404
    assert get(app, "/v1/load_stats")[0] == 200  # the endpoint is API, not console
    # With a key and no console, / is closed like every other route.
    assert get(app_for(api_key=KEY, ui=False), "/")[0] == 401


def test_serve_flag_no_ui():
    from tensorstream.cli.serve import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    assert parser.parse_args(["m"]).ui is True
    assert parser.parse_args(["m", "--no-ui"]).ui is False


def test_static_files_are_complete_and_offline():
    on_disk = {p.name for p in STATIC.iterdir()}
    assert on_disk == set(STATIC_FILES)
    html = (STATIC / "index.html").read_text()
    referenced = set(re.findall(r'(?:src|href)="/console/([^"]+)"', html))
    for name in STATIC_FILES:
        if name.endswith(".js"):
            referenced |= set(re.findall(r'from "\./([^"]+)"', (STATIC / name).read_text()))
    assert referenced <= set(STATIC_FILES)
    assert {"main.js", "console.css", "favicon.svg"} <= referenced
    for name in STATIC_FILES:
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"https?://[^\s\"')]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}: the console must work offline"


def test_wheel_ships_the_console(tmp_path: Path):
    work = tmp_path / "src-copy"
    work.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, work / name)
    shutil.copytree(
        REPO / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "dist"), str(work)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("tensorstream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {f"tensorstream/server/console/static/{n}" for n in STATIC_FILES} - names
    assert not missing


def stats(**kw) -> LoadStats:
    base = dict(
        load_format="tensorizer",
        uri="http://h/m/model.tensors",
        bytes=269_000_000,
        read_seconds=1.0,
        build_seconds=0.25,
        usable_seconds=1.5,
    )
    return LoadStats(**{**base, **kw})


def test_timeline_places_the_load_inside_the_llm_call():
    timeline = StartupTimeline()
    timeline.add("startup", "interpreter", 0.0, 2.0)
    timeline.model_loaded(stats(), started=3.0, ended=5.0, readers=4)
    timeline.mark_ready()
    body = timeline.as_json()
    phases = {p["name"]: p for p in body["phases"]}
    assert [p["name"] for p in body["phases"]] == [
        "startup",
        "weights_read",
        "model_built",
        "engine",
    ]
    assert (phases["weights_read"]["start"], phases["weights_read"]["end"]) == (3.0, 4.0)
    assert phases["weights_read"]["readers"] == 4
    assert phases["weights_read"]["gb_per_s"] == pytest.approx(0.269)
    assert (phases["model_built"]["start"], phases["model_built"]["end"]) == (4.25, 4.5)
    assert (phases["engine"]["start"], phases["engine"]["end"]) == (4.5, 5.0)
    assert body["model"]["bytes_read"] == 269_000_000 and body["status"] == "ready"
    assert body["ready_at"] is not None


def test_timeline_clips_load_figures_to_the_llm_call():
    """LoadStats longer than the measured call (clock skew) never draws past its end."""
    timeline = StartupTimeline()
    timeline.model_loaded(stats(read_seconds=9.0, usable_seconds=9.5), started=1.0, ended=2.0)
    phases = {p["name"]: p for p in timeline.as_json()["phases"]}
    assert max(p["end"] for p in phases.values()) == 2.0
    assert phases["engine"]["seconds"] == 0.0


def test_timeline_of_a_model_loaded_elsewhere_has_figures_but_no_bars():
    timeline = StartupTimeline()
    timeline.model_loaded(stats(mapped_bytes=269_000_000))
    body = timeline.as_json()
    assert body["phases"] == []
    assert body["model"]["mapped_bytes"] == 269_000_000 and body["model"]["bytes_read"] == 0
    assert body["model"]["gb_per_s"] == 0.0  # nothing read, no rate


def test_timeline_adapter_loads_and_unloads():
    timeline = StartupTimeline()
    timeline.adapter_loaded("a", "/r/a", "runtime", 10.0, 10.5)
    timeline.adapter_loaded("b", "/r/b", "startup", 3.0, 3.25)
    timeline.adapter_unloaded("a")
    timeline.adapter_unloaded("missing")  # nothing to mark, no error
    a, b = timeline.as_json()["adapters"]
    assert (a["name"], a["seconds"], a["source"]) == ("a", 0.5, "runtime")
    assert a["unloaded_at"] is not None and b["unloaded_at"] is None


def test_timeline_phase_context_manager_and_running_phase():
    timeline = StartupTimeline()
    with timeline.phase("imports", "imports"):
        pass
    timeline.add("load", "loading", timeline.now(), None)
    first, running = timeline.as_json()["phases"]
    assert first["end"] >= first["start"] and first["seconds"] >= 0
    assert running["end"] is None and running["seconds"] is None
