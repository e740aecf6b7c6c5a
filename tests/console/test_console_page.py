"""The console in a real browser against a real server: key prompt, no console errors,
the timeline's figures equal /v1/load_stats, a streamed chat equals the API's greedy
answer, metrics follow /metrics, adapters load and unload through the page.

Tests in this module share one server and one browser and run in file order (the
key is entered once, in the first test).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser_driver import browser_errors, by_id, js_fixed, js_seconds, text_of, wait_for
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from conftest import API_KEY, READERS, SERVED_NAME

PROMPT = "Name three colors."
MAX_TOKENS = 24


def api_json(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    return server.request(method, path, body)


def greedy_chat(server, model: str, prompt: str) -> str:
    status, body = api_json(
        server,
        "POST",
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        },
    )
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def model_ids(server) -> list[str]:
    status, body = api_json(server, "GET", "/v1/models")
    assert status == 200, body
    return [m["id"] for m in body["data"]]


def ask_in_page(driver, model: str, prompt: str) -> tuple[str, object]:
    """Send ``prompt`` from the playground greedily; return the answer text and its node."""
    from selenium.webdriver.support.ui import Select

    by_id(driver, "chat-clear").click()  # a new conversation: the API call sends one message
    Select(by_id(driver, "chat-model")).select_by_value(model)
    for field, value in (("chat-temperature", "0"), ("chat-max-tokens", str(MAX_TOKENS))):
        box = by_id(driver, field)
        box.clear()
        box.send_keys(value)
    before = len(driver.find_elements(By.CSS_SELECTOR, '#chat-log [data-role="assistant"]'))
    by_id(driver, "chat-input").send_keys(prompt, Keys.ENTER)  # Enter sends
    wait_for(
        driver,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, '#chat-log [data-done="true"]')) > before,
        "the streamed answer to finish",
    )
    node = driver.find_elements(By.CSS_SELECTOR, '#chat-log [data-role="assistant"]')[-1]
    return text_of(node.find_element(By.CLASS_NAME, "text")), node


def test_page_asks_for_the_key_and_the_api_stays_closed(console_server, browser):
    browser.get(console_server.base_url + "/")
    panel = wait_for(
        browser,
        lambda d: by_id(d, "key-panel").is_displayed() and by_id(d, "key-panel"),
        "the key panel",
    )
    assert by_id(browser, "key-input") == browser.switch_to.active_element
    # Without the key the API is closed, from outside and from the page's own origin.
    assert console_server.request("GET", "/v1/models", None, auth=False)[0] == 401
    assert console_server.request("GET", "/v1/load_stats", None, auth=False)[0] == 401
    status = browser.execute_async_script(
        "const done = arguments[0]; fetch('/v1/models').then(r => done(r.status));"
    )
    assert status == 401
    browser.get_log("browser")  # drain: the fetch above was refused on purpose

    # A wrong key is refused by the server and the panel says so.
    by_id(browser, "key-input").send_keys("not-the-key", Keys.ENTER)
    wait_for(browser, lambda d: "refused" in text_of(by_id(d, "key-error")), "the refusal")
    assert panel.is_displayed()
    browser.get_log("browser")  # the refused request is logged by Chromium; expected

    by_id(browser, "key-input").send_keys(API_KEY, Keys.ENTER)
    wait_for(browser, lambda d: not by_id(d, "key-panel").is_displayed(), "the panel to close")
    wait_for(browser, lambda d: text_of(by_id(d, "model-name")) == SERVED_NAME, "the model name")
    assert browser.execute_script("return sessionStorage.getItem('tensorstream.apiKey')") == API_KEY


def test_page_loads_without_console_errors(console_server, browser):
    browser.get_log("browser")
    browser.refresh()  # the key stays in sessionStorage for this tab
    wait_for(browser, lambda d: text_of(by_id(d, "server-status")) == "ready", "ready status")
    wait_for(
        browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-metric="running"]'), "metrics"
    )
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-model option"), "models")
    assert not by_id(browser, "key-panel").is_displayed()
    assert browser_errors(browser) == []


def test_timeline_shows_the_load_figures_of_load_stats(console_server, browser):
    status, stats = api_json(console_server, "GET", "/v1/load_stats")
    assert status == 200, stats
    assert stats["status"] == "ready"
    phases = {p["name"]: p for p in stats["phases"]}
    assert list(phases) == ["startup", "imports", "weights_read", "model_built", "engine"]
    model = stats["model"]
    # Over HTTP nothing is mapped: every byte was read, with a rate and the readers asked for.
    assert model["bytes_read"] == model["bytes"] > 200_000_000
    assert model["mapped_bytes"] == 0 and model["gb_per_s"] > 0
    assert phases["weights_read"]["readers"] == READERS
    order = [phases[n] for n in ("startup", "imports", "weights_read")]
    assert all(a["end"] <= b["start"] + 1e-3 for a, b in zip(order, order[1:], strict=False))
    assert phases["engine"]["end"] <= stats["ready_at"]

    for name, phase in phases.items():
        row = wait_for(
            browser,
            lambda d, n=name: d.find_element(By.CSS_SELECTOR, f'#timeline tr[data-phase="{n}"]'),
            f"timeline row {name}",
        )
        cells = {
            c.get_attribute("data-field"): text_of(c) for c in row.find_elements(By.TAG_NAME, "td")
        }
        assert cells["start"] == js_seconds(phase["start"]), name
        assert cells["seconds"] == js_seconds(phase["seconds"]), name
        bar = row.find_element(By.CSS_SELECTOR, "rect")
        assert bar.get_attribute("x").endswith("%")
    detail = text_of(
        browser.find_element(
            By.CSS_SELECTOR, '#timeline tr[data-phase="weights_read"] [data-field="detail"]'
        )
    )
    mb = js_fixed(model["bytes_read"] / 1e6, 1)
    assert detail == f"{mb} MB read, {js_fixed(model['gb_per_s'])} GB/s; {READERS} readers"
    ready = browser.find_element(
        By.CSS_SELECTOR, '#timeline tr[data-phase="ready"] [data-field="start"]'
    )
    assert text_of(ready) == js_seconds(stats["ready_at"])
    assert js_seconds(stats["ready_at"]) in text_of(by_id(browser, "timeline-summary"))


def test_chat_streams_the_greedy_answer_of_the_api(console_server, browser):
    expected = greedy_chat(console_server, SERVED_NAME, PROMPT)
    assert expected.strip()
    answer, node = ask_in_page(browser, SERVED_NAME, PROMPT)
    assert answer == expected
    assert int(node.get_attribute("data-chunks")) > 1  # it arrived in pieces: streamed
    stats = text_of(node.find_element(By.CSS_SELECTOR, '[data-field="stats"]'))
    assert stats.startswith("TTFT ") and " tok/s" in stats and "tokens" in stats
    assert browser_errors(browser) == []


def test_metrics_panel_follows_the_servers_metrics(console_server, browser):
    """The tiles show /metrics' own counts; the JS quantile equals histogram_quantile's."""
    samples = console_server.metrics()
    finished = sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total"))
    assert finished >= 2  # the two greedy chats above
    wait_for(
        browser,
        lambda d: (
            text_of(d.find_element(By.CSS_SELECTOR, '[data-metric="finished"]'))
            == str(int(finished))
        ),
        f"'Requests finished' to read {finished}",
    )
    text = console_server.metrics_text()
    got = browser.execute_async_script(
        "const [text, done] = arguments;"
        "import('/console/prometheus.js').then(m => {"
        "  const s = m.parse(text);"
        "  done([0.5, 0.9, 0.99].map(q => m.quantile(s, 'vllm:e2e_request_latency_seconds', q)));"
        "});",
        text,
    )
    assert got == pytest.approx(
        [histogram_quantile(text, "vllm:e2e_request_latency_seconds", q) for q in (0.5, 0.9, 0.99)]
    )
    row = browser.find_element(
        By.CSS_SELECTOR, '#quantiles [data-metric="vllm:time_to_first_token_seconds"]'
    )
    assert all(text_of(td) != "–" for td in row.find_elements(By.TAG_NAME, "td"))


def histogram_quantile(text: str, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over one scrape, in Python, for comparison."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                bound = float(s.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + s.value
    ordered = sorted(buckets.items())
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def test_adapter_load_and_unload_from_the_page(console_server, browser, adapter_root: Path):
    assert model_ids(console_server) == [SERVED_NAME]
    by_id(browser, "adapter-name").send_keys("style")
    by_id(browser, "adapter-path").send_keys(str(adapter_root / "style"))
    by_id(browser, "adapter-load").click()
    message = by_id(browser, "adapter-message")
    wait_for(browser, lambda d: text_of(message).startswith("Success"), "the load to succeed")
    assert model_ids(console_server) == [SERVED_NAME, "style"]
    wait_for(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, '#adapter-list tr[data-adapter="style"]'),
        "the adapter row",
    )
    wait_for(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, '#adapter-timeline tr[data-adapter="style"]'),
        "its load bar",
    )
    _, stats = api_json(console_server, "GET", "/v1/load_stats")
    (load,) = stats["adapters"]
    took = browser.find_element(
        By.CSS_SELECTOR, '#adapter-timeline tr[data-adapter="style"] [data-field="seconds"]'
    )
    assert (load["name"], load["source"]) == ("style", "runtime")
    assert text_of(took) == js_seconds(load["seconds"])

    # The playground offers the adapter and its greedy answer is the API's.
    wait_for(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, '#chat-model option[value="style"]'),
        "the adapter in the menu",
    )
    answer, _ = ask_in_page(browser, "style", PROMPT)
    assert answer == greedy_chat(console_server, "style", PROMPT)
    _maybe_screenshot(browser)

    # A location outside the allowed root: the server's refusal is shown as it is.
    outside = adapter_root.parent / "elsewhere"
    status, refusal = api_json(
        console_server,
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "x", "lora_path": str(outside)},
    )
    assert status == 403
    by_id(browser, "adapter-name").send_keys("x")
    by_id(browser, "adapter-path").clear()
    by_id(browser, "adapter-path").send_keys(str(outside))
    by_id(browser, "adapter-load").click()
    wait_for(browser, lambda d: message.get_attribute("data-state") == "error", "the refusal")
    assert text_of(message) == f"Refused (403): {refusal['error']['message']}"
    assert model_ids(console_server) == [SERVED_NAME, "style"]

    browser.find_element(By.CSS_SELECTOR, '#adapter-list tr[data-adapter="style"] button').click()
    wait_for(browser, lambda d: text_of(message).startswith("Success"), "the unload to succeed")
    assert model_ids(console_server) == [SERVED_NAME]
    wait_for(
        browser,
        lambda d: not d.find_elements(By.CSS_SELECTOR, '#adapter-list tr[data-adapter="style"]'),
        "the row to go",
    )
    errors = [e for e in browser_errors(browser) if "load_lora_adapter" not in e["message"]]
    assert errors == []  # only the deliberate 403 was logged


def _maybe_screenshot(driver) -> None:
    """With TENSORSTREAM_CONSOLE_SCREENSHOT=PATH, save the whole page there (docs/console.png)."""
    target = os.environ.get("TENSORSTREAM_CONSOLE_SCREENSHOT")
    if not target:
        return
    driver.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    metrics = {"width": 1366, "height": int(height), "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        driver.save_screenshot(target)
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
