"""``tensorstream serve`` from a local tensorized directory, driven by the official openai client."""

from __future__ import annotations

import json
import shutil
import threading
import time

import openai
import pytest
import torch
from serveproc import ServeProcess

from conftest import API_KEY, SERVED_NAME
from tensorstream.engine import SamplingParams
from tensorstream.engine.cpu_dtype import cpu_matmul_supported

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = dict(temperature=0, max_tokens=12)


def _expected(llm, prompt, **kw):
    params = SamplingParams(**{**GREEDY, **kw})
    return llm.generate(prompt, params)[0]


def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_ready_with_load_metrics_and_mapped_log_line(local_server):
    statuses = [status for status, _ in local_server.health_seen]
    assert statuses[-1] == 200
    metrics = local_server.metrics()
    assert metrics["tensorstream_ready"] == 1
    assert metrics["tensorstream_model_load_bytes"] > 100e6  # SmolLM2-135M in bf16
    assert metrics["tensorstream_model_load_seconds"] > 0
    log = local_server.log.read_text()
    ready = next(line for line in log.splitlines() if "ready:" in line)
    if cpu_matmul_supported(torch.bfloat16):
        # A local CPU load maps the file: reported as mapped, with no GB/s (issue #16).
        assert "mapped from the page cache" in ready and "GB/s" not in ready
    else:  # auto computes the bf16 file in float32 here (engine/cpu_dtype.py): a read
        assert "GB/s" in ready and "mapped from the page cache" not in ready


def test_answers_503_while_loading_then_ready(tensorized_dir, http_server, tmp_path):
    # A local mapped load can finish before the first probe; nginx's rate-limited view
    # makes this load take seconds on any machine (4 readers x SLOW_RATE_BYTES/s).
    served = http_server.root / "slow-model"
    shutil.copytree(tensorized_dir, served, dirs_exist_ok=True)
    extra = json.dumps({"deserialization_kwargs": {"num_readers": 4}})
    args = [http_server.slow_url("slow-model"), "--load-format", "tensorizer"]
    server = ServeProcess.start([*args, "--model-loader-extra-config", extra], tmp_path / "log")
    try:
        statuses = [status for status, _ in server.health_seen]
        assert statuses[-1] == 200
        assert 503 in statuses, f"never saw 503 while loading: {statuses[:5]}"
        body = next(b for s, b in server.health_seen if s == 503)
        assert body["error"]["type"] == "ServiceUnavailableError"
        assert "loading" in body["error"]["message"]
        assert server.metrics()["tensorstream_ready"] == 1
    finally:
        server.stop()


def test_models_list(client, reference_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].owned_by == "tensorstream"


def test_completion_equals_llm_generate(client, reference_llm):
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, **GREEDY)
    assert len(response.choices) == 2
    for choice, prompt in zip(
        sorted(response.choices, key=lambda c: c.index), PROMPTS, strict=True
    ):
        expected = _expected(reference_llm, prompt).outputs[0]
        assert choice.text == expected.text
        assert choice.finish_reason == expected.finish_reason
    prompt_tokens = sum(len(_expected(reference_llm, p).prompt_token_ids) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == prompt_tokens + 24


def test_chat_equals_llm_chat(client, reference_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    expected = reference_llm.chat(messages, SamplingParams(**GREEDY))[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.object == "chat.completion"


def test_streaming_completion(client, reference_llm):
    expected = _expected(reference_llm, PROMPTS[0]).outputs[0]
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS[0],
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert sum(1 for c in chunks if c.choices) > 1, "the answer was not streamed"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_streaming_chat_ends_with_done(local_server, client, reference_llm):
    messages = [{"role": "user", "content": "Name a color."}]
    expected = reference_llm.chat(messages, SamplingParams(**GREEDY))[0].outputs[0].text
    chunks = list(
        client.chat.completions.create(model=SERVED_NAME, messages=messages, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    # The raw event stream ends with OpenAI's sentinel.
    import urllib.request

    req = urllib.request.Request(
        local_server.base_url + "/v1/chat/completions",
        data=(
            b'{"model": "smol", "messages": [{"role": "user", "content": "Hi"}],'
            b' "max_tokens": 3, "stream": true}'
        ),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.rstrip().endswith("data: [DONE]")


def test_sampling_options(client, reference_llm):
    # n and seed: two different samples, reproducible with the same seed.
    kw = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    first = client.completions.create(n=2, seed=7, **kw)
    again = client.completions.create(n=2, seed=7, **kw)
    assert len(first.choices) == 2
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    # stop: the reference's text cut before the stop string.
    full = _expected(reference_llm, PROMPTS[0]).outputs[0].text
    stop = full.strip().split()[1]
    cut = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # logprobs: top-2 alternatives per generated token.
    lp = (
        client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == 12 and len(lp.top_logprobs) == 12
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == full
    chat = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=4,
        temperature=0,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)


def test_tokenize_detokenize(local_server, reference_llm):
    status, body = local_server.request("POST", "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200
    assert body["tokens"] == list(reference_llm.tokenizer(PROMPTS[0])["input_ids"])
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    status, body = local_server.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == PROMPTS[0]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "abc"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1] * 8200, "max_tokens": 1}, 400, "context length"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 9000}, 400, "context length"),
        ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user"}]}, 404, "nope"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "never-loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 403, "x"),
        ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ],
)
def test_bad_requests_get_openai_errors(local_server, path, body, status, needle):
    got, payload = local_server.request("POST", path, body)
    assert got == status, payload
    error = payload["error"]
    assert needle in error["message"] or needle == error.get("param"), error
    assert {"message", "type", "param", "code"} <= set(error)
    assert error["code"] == status  # vLLM's shape: the HTTP status as an int


def test_malformed_json_and_auth(local_server, client):
    status, payload = local_server.request("POST", "/v1/completions", b"{not json")
    assert status == 400 and "error" in payload
    status, payload = local_server.request("POST", "/v1/completions", {"prompt": "a"}, auth=False)
    assert status == 401 and payload["error"]["code"] == 401
    status, _ = local_server.request(
        "GET", "/v1/models", None, headers={"Authorization": "Bearer wrong"}
    )
    assert status == 401
    wrong = openai.OpenAI(base_url=local_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=-5)
    # Still alive and serving after every bad request.
    assert local_server.get_json("/health")[0] == 200
    assert client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=2).choices


def test_disconnected_stream_is_aborted(local_server, client):
    aborts = 'vllm:request_success_total{finished_reason="abort",model_name="smol"}'
    before = local_server.metrics().get(aborts, 0)
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt="Tell me a very long story.",
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()  # drops the connection mid-stream

    def aborted() -> bool:
        m = local_server.metrics()
        return m.get(aborts, 0) > before and m['vllm:num_requests_running{model_name="smol"}'] == 0

    _wait_for(aborted, timeout=60, what="the abandoned request to be aborted")


def test_slow_stream_reader_does_not_hold_others(client, reference_llm):
    slow = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPTS[0],
        stream=True,
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    it = iter(slow)
    first = next(it)
    # The slow reader pauses; a short request still finishes while it waits.
    started = time.monotonic()
    quick = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], **GREEDY)
    assert quick.choices[0].text == _expected(reference_llm, PROMPTS[1]).outputs[0].text
    assert time.monotonic() - started < 120
    rest = [first, *it]
    text = "".join(c.choices[0].text for c in rest if c.choices)
    expected = _expected(reference_llm, PROMPTS[0], max_tokens=40, ignore_eos=True)
    assert text == expected.outputs[0].text


def test_sixteen_concurrent_streams(local_server, reference_llm):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "My favourite fruit is",
        "Water boils at",
    ]
    expected = {p: _expected(reference_llm, p).outputs[0].text for p in prompts}
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    seen = {"running": 0.0, "waiting": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = local_server.metrics()
            seen["running"] = max(
                seen["running"], m['vllm:num_requests_running{model_name="smol"}']
            )
            seen["waiting"] = max(
                seen["waiting"], m['vllm:num_requests_waiting{model_name="smol"}']
            )
            time.sleep(0.05)

    def worker(i: int) -> None:
        try:
            c = openai.OpenAI(
                base_url=local_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
            )
            stream = c.completions.create(
                model=SERVED_NAME, prompt=prompts[i % 4], stream=True, **GREEDY
            )
            results[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    done.set()
    watcher.join(timeout=10)
    assert not errors, errors[:3]
    assert len(results) == 16, "some clients never finished"
    for i, text in results.items():
        assert text == expected[prompts[i % 4]], (i, text)
    # --max-num-seqs 4: never more than 4 running; the rest waited their turn.
    assert 1 <= seen["running"] <= 4
    assert seen["waiting"] >= 1
    m = local_server.metrics()
    assert m['vllm:time_to_first_token_seconds_count{model_name="smol"}'] >= 16
    assert m['vllm:generation_tokens_total{model_name="smol"}'] >= 16 * 12
    assert m['tensorstream_http_requests_total{path="/v1/completions",status="200"}'] >= 16
