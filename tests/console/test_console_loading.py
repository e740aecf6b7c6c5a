"""The page while the model loads: the timeline fills in from /v1/load_stats and the
status follows it (loading, then failed). The server is the real app on a real socket,
in this process, with a state that never gets a model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from browser_driver import browser_errors, by_id, text_of, wait_for
from selenium.webdriver.common.by import By

from tensorstream.server.app import ServeOptions, ServerState, create_app


@pytest.fixture
def loading_server() -> Iterator[tuple[str, ServerState]]:
    import uvicorn

    state = ServerState(ServeOptions(served_model_name="smol"))
    state.timeline.add("startup", "interpreter, torch import, CLI", 0.0, 1.25)
    state.timeline.add("imports", "server and engine imports", 1.25, 2.0)
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and server.servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)


def test_page_follows_the_load_and_its_failure(loading_server, browser):
    url, state = loading_server
    browser.get(url + "/")
    wait_for(browser, lambda d: text_of(by_id(d, "server-status")) == "loading…", "loading")
    rows = wait_for(
        browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline tr[data-phase]"), "rows"
    )
    assert [r.get_attribute("data-phase") for r in rows] == ["startup", "imports", "loading"]
    assert "Loading…" in text_of(by_id(browser, "timeline-summary"))
    # A phase recorded now shows up on the next poll (every second while loading).
    state.timeline.add("weights_read", "weights read", 2.0, None)
    wait_for(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, '#timeline tr[data-phase="weights_read"]'),
        "the running phase",
    )
    cell = browser.find_element(
        By.CSS_SELECTOR, '#timeline tr[data-phase="weights_read"] [data-field="seconds"]'
    )
    assert text_of(cell) == "running"
    state.fail("cannot read s3://b/m/model.tensors")
    wait_for(browser, lambda d: text_of(by_id(d, "server-status")) == "load failed", "failed")
    summary = text_of(by_id(browser, "timeline-summary"))
    assert summary == "Loading failed: cannot read s3://b/m/model.tensors"
    assert browser_errors(browser) == []  # the page never asked for /v1/models while loading
