"""A server without runtime adapter loading and without an API key: the page opens
straight away, says loading over HTTP is off, and shows the server's own refusal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from browser_driver import browser_errors, by_id, text_of, wait_for
from selenium.webdriver.common.by import By
from serveproc import ServeProcess


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The built-in model from local disk, LoRA on, runtime loading off, no key."""
    log = tmp_path_factory.mktemp("serve-console-plain") / "serve.log"
    server = ServeProcess.start(
        ["smollm2-135m", "--device", "cpu", "--enable-lora", "--shutdown-timeout", "5"], log
    )
    try:
        yield server
    finally:
        server.stop()


def test_refusal_is_shown_when_runtime_loading_is_off(plain_server, browser, tmp_path):
    browser.get(plain_server.base_url + "/")
    wait_for(browser, lambda d: text_of(by_id(d, "server-status")) == "ready", "ready status")
    assert not by_id(browser, "key-panel").is_displayed()  # no key on this server
    assert not by_id(browser, "key-button").is_displayed()
    assert "off" in text_of(by_id(browser, "adapters-policy"))
    assert browser_errors(browser) == []

    request = {"lora_name": "a", "lora_path": str(tmp_path)}
    status, refusal = plain_server.request("POST", "/v1/load_lora_adapter", request)
    assert status == 403 and "--enable-runtime-lora-updating" in refusal["error"]["message"]
    by_id(browser, "adapter-name").send_keys("a")
    by_id(browser, "adapter-path").send_keys(str(tmp_path))
    by_id(browser, "adapter-load").click()
    message = by_id(browser, "adapter-message")
    wait_for(browser, lambda d: message.get_attribute("data-state") == "error", "the refusal")
    assert text_of(message) == f"Refused (403): {refusal['error']['message']}"
    status, models = plain_server.request("GET", "/v1/models", None)
    assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#adapter-list tr[data-adapter]")
    assert rows == []
