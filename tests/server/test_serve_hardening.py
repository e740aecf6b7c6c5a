"""The server cannot be turned against its host (issue #15) and says no clearly (issue #16).

Real ``tensorstream serve`` processes and real sockets: the shared ``local_server``
(configured through vLLM's environment variables, with allowed LoRA roots, a 3 s
header timeout and a 3 s chat-template budget) and a ``plain_server`` with default
switches and a small per-request bound.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serveproc import ServeProcess

from conftest import API_KEY, HEADER_TIMEOUT_S, SERVED_NAME
from tensorstream.engine.cpu_dtype import cpu_matmul_supported

M = '{model_name="smol"}'
LOOPING_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, tensorized_dir):
    """Default switches (no API key, no runtime LoRA), 2 seats, 8 sequences per request."""
    log = tmp_path_factory.mktemp("serve-plain") / "serve.log"
    server = ServeProcess.start(
        [
            str(tensorized_dir),
            "--load-format",
            "tensorizer",
            "--served-model-name",
            SERVED_NAME,
            "--device",
            "cpu",
            "--max-num-seqs",
            "2",
            "--max-seqs-per-request",
            "8",
        ],
        log,
    )
    try:
        yield server
    finally:
        server.stop()


def _load(server, name, path, **extra):
    return server.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **extra}
    )


# -- runtime LoRA: opt-in, confined, quiet ----------------------------------------------


def test_runtime_lora_loading_is_off_by_default(plain_server, tmp_path):
    status, body = _load(plain_server, "a", str(tmp_path))
    assert status == 403, body
    assert "--enable-runtime-lora-updating" in body["error"]["message"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in body["error"]["message"]
    status, body = plain_server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 403, body


def test_lora_locations_outside_the_roots_are_refused(
    local_server, lora_roots, http_server, s3_server, tmp_path
):
    root = lora_roots["local"]
    (tmp_path / "secret").write_bytes(b"x" * 631)
    (root / "escape").symlink_to(tmp_path, target_is_directory=True)
    other_bucket = s3_server.make_bucket("not-allowed")
    host = lora_roots["http"].split("/")[2]
    refused = [
        "/etc/passwd",
        str(tmp_path / "secret"),
        str(root / "escape"),  # symlink out of the root
        f"{root}/../{tmp_path.name}",
        http_server.forbidden_url("x"),  # same host, outside the prefix
        lora_roots["http"] + "-other/x",
        lora_roots["http"].replace("http://", "https://") + "/x",
        f"http://{host}@169.254.169.254/latest/meta-data",
        "http://169.254.169.254/latest/meta-data",
        f"s3://{other_bucket}/allowed/x",
        lora_roots["http"] + "/%2e%2e/secret",
        "gs://bucket/x",
    ]
    for location in refused:
        status, answer = _load(local_server, "evil", location)
        assert status == 403, (location, answer)
        message = answer["error"]["message"]
        assert "not allowed" in message and answer["error"]["code"] == 403
        assert "631" not in message and "bytes" not in message and "403" not in message
        assert str(tmp_path) not in message or str(tmp_path) in location
    # The key file is confined too.
    status, answer = _load(
        local_server, "evil", str(root), encryption_keyfile=str(tmp_path / "secret")
    )
    assert status == 403 and answer["error"]["param"] == "encryption_keyfile", answer
    assert local_server.metrics()['tensorstream_adapter_loads_total{result="refused"}'] >= len(
        refused
    )


def test_missing_adapters_inside_the_roots_are_plain_not_found(local_server, lora_roots):
    for location in (
        str(lora_roots["local"] / "missing"),
        f"{lora_roots['http']}/missing",  # nginx answers 404
        f"{lora_roots['s3']}/missing",
    ):
        status, answer = _load(local_server, "ghost", location)
        assert status == 404, (location, answer)
        message = answer["error"]["message"]
        assert message == f"cannot load adapter 'ghost': no readable adapter at {location!r}"


@pytest.fixture(scope="module")
def high_rank_adapter(builtin_dir, lora_roots):
    import peft
    import torch
    import transformers

    out = lora_roots["local"] / "rank-32"
    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_dir)
    torch.manual_seed(2)
    config = peft.LoraConfig(r=32, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def test_rank_error_names_the_server_flag(local_server, high_rank_adapter):
    status, answer = _load(local_server, "too-wide", str(high_rank_adapter))
    assert status == 400, answer
    message = answer["error"]["message"]
    assert "--max-lora-rank" in message and "max_lora_rank=" not in message, message


# -- API key --------------------------------------------------------------------------


def test_vllm_api_key_is_honoured(local_server):
    # local_server got its key only through VLLM_API_KEY.
    assert "--api-key" not in local_server.proc.args
    for path in ("/v1/models", "/docs", "/openapi.json", "/version"):
        status, body = local_server.request("GET", path, None, auth=False)
        assert status == 401, (path, body)
        assert body["error"]["code"] == 401
        assert local_server.request("GET", path, None)[0] == 200, path
    for path in ("/health", "/metrics"):
        req = urllib.request.Request(local_server.base_url + path)
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200, path


# -- chat templates ---------------------------------------------------------------------


def test_a_runaway_chat_template_does_not_freeze_the_server(local_server, client):
    result: dict = {}

    def runaway() -> None:
        result["answer"] = local_server.request(
            "POST",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template": LOOPING_TEMPLATE,
                "max_tokens": 1,
            },
            timeout=120,
        )

    worker = threading.Thread(target=runaway)
    worker.start()
    health = []
    while worker.is_alive():
        started = time.monotonic()
        status, _ = local_server.get_json("/health", timeout=30)
        health.append((status, time.monotonic() - started))
        time.sleep(0.2)
    worker.join()
    status, body = result["answer"]
    assert status == 400, body
    assert "--chat-template-timeout" in body["error"]["message"]
    assert body["error"]["param"] == "messages"
    assert len(health) >= 3, "the runaway render ended too soon to observe /health"
    assert all(s == 200 for s, _ in health), health
    # A generous bound: /health answered while the template ran (it froze 57 s before).
    assert max(seconds for _, seconds in health) < 5, health
    # The server still renders ordinary chats.
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content is not None


def test_request_chat_templates_need_trust_and_text_is_bounded(plain_server):
    status, body = plain_server.request(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"},
    )
    assert status == 400 and body["error"]["param"] == "chat_template", body
    assert "--trust-request-chat-template" in body["error"]["message"]
    huge = [{"role": "user", "content": "a" * (1 << 20)} for _ in range(5)]
    status, body = plain_server.request(
        "POST", "/v1/chat/completions", {"messages": huge, "max_tokens": 1}
    )
    assert status == 413 and body["error"]["code"] == 413, body


# -- request bounds and fairness -------------------------------------------------------


def test_prompts_times_n_is_bounded(plain_server):
    status, body = plain_server.request(
        "POST", "/v1/completions", {"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 1}
    )
    assert status == 400, body
    assert (
        "--max-seqs-per-request" in body["error"]["message"] and "16000" in body["error"]["message"]
    )
    status, body = plain_server.request(
        "POST", "/v1/completions", {"prompt": ["hi"] * 5, "n": 2, "max_tokens": 1}
    )
    assert status == 400 and "8" in body["error"]["message"], body


def test_queued_prompts_run_when_the_batch_drains(plain_server):
    # 2 seats, 4 prompts x n=2: each prompt fills the batch alone. The engine thread used
    # to sleep once a step finished every running request, stranding the queue.
    status, body = plain_server.request(
        "POST", "/v1/completions", {"prompt": ["hi"] * 4, "n": 2, "max_tokens": 1}, timeout=120
    )
    assert status == 200 and len(body["choices"]) == 8, body


def test_a_big_request_does_not_starve_a_small_one(local_server):
    waiting = f"vllm:num_requests_waiting{M}"
    big_prompts = [f"Story number {i} begins with" for i in range(40)]
    result: dict = {}

    def big() -> None:
        result["big"] = local_server.request(
            "POST",
            "/v1/completions",
            {"prompt": big_prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
            timeout=600,
        )

    worker = threading.Thread(target=big)
    worker.start()
    deadline = time.monotonic() + 120
    while local_server.metrics()[waiting] < 20:
        assert worker.is_alive() and time.monotonic() < deadline, "the big request never queued"
        time.sleep(0.05)
    status, small = local_server.request(
        "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    )
    left_waiting = local_server.metrics()[waiting]
    worker.join(timeout=600)
    assert status == 200 and small["choices"], small
    # Round-robin admission: the small request got the next free seat, so most of the big
    # one's prompts were still waiting when it finished (first-come would have admitted
    # all 40 first).
    assert left_waiting >= 10, left_waiting
    status, body = result["big"]
    assert status == 200 and len(body["choices"]) == 40


# -- bad input is a 400 -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}',
            "messages",
        ),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
        ("/tokenize", b'{"prompt": "\\udfff"}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": "a", "seed": 9223372036854775808}', "seed"),
    ],
)
def test_lone_surrogates_and_huge_seeds_are_400(local_server, path, raw, param):
    status, body = local_server.request("POST", path, raw)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["code"] == 400, body


UNSUPPORTED = [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "bad_words", ["x"]),
    ("/v1/completions", "use_beam_search", True),
]
ACCEPTED = [
    ("/v1/chat/completions", {"tools": None, "tool_choice": "none", "logit_bias": None}),
    ("/v1/chat/completions", {"tools": [], "response_format": {"type": "text"}}),
    ("/v1/completions", {"logit_bias": {}, "min_p": 0.0, "unknown_future_field": 1}),
]


def test_unimplemented_openai_fields_are_refused(local_server):
    base = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
    }
    for path, field, value in UNSUPPORTED:
        status, body = local_server.request(
            "POST", path, {**base[path], "max_tokens": 1, field: value}
        )
        assert status == 400, (field, body)
        assert body["error"]["param"] == field and repr(field) in body["error"]["message"]
    for path, fields in ACCEPTED:
        status, body = local_server.request("POST", path, {**base[path], "max_tokens": 1, **fields})
        assert status == 200, (fields, body)


def test_vllm_sampling_fields_are_honoured_over_http(local_server):
    """logit_bias, min_p, min_tokens and allowed_token_ids reach SamplingParams."""
    favoured = 314
    status, body = local_server.request(
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 3, "temperature": 0, "logit_bias": {str(favoured): 100}},
    )
    assert status == 200, body
    status, expected = local_server.request("POST", "/detokenize", {"tokens": [favoured] * 3})
    assert status == 200, expected
    assert body["choices"][0]["text"] == expected["prompt"]

    status, body = local_server.request(
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "temperature": 0, "allowed_token_ids": [favoured]},
    )
    assert (
        status == 200
        and body["choices"][0]["text"] == expected["prompt"][: len(body["choices"][0]["text"])]
    ), body
    assert body["usage"]["completion_tokens"] == 2, body

    status, body = local_server.request(
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 4, "min_p": 0.1, "temperature": 0},
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    status, body = local_server.request(
        "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"not-a-token": 1}}
    )
    assert status == 400 and body["error"]["param"] == "logit_bias", body


# -- sockets: slow headers, disconnects --------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (None if it stayed open for ``seconds``)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if trickle:
            try:
                sock.sendall(trickle)
            except OSError:
                return time.monotonic() - started
        readable, _, _ = select.select([sock], [], [], 0.5)
        if readable:
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - started
            except OSError:
                return time.monotonic() - started
    return None


def test_slow_and_silent_sockets_are_closed(local_server):
    bound = HEADER_TIMEOUT_S * 5  # generous: the server closes them after HEADER_TIMEOUT_S
    silent = socket.create_connection(("127.0.0.1", local_server.port))
    slow = socket.create_connection(("127.0.0.1", local_server.port))
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(slow, bound, trickle=b"X") is not None, "slow-loris kept open"
        assert _closed_within(silent, bound) is not None, "silent socket kept open"
    finally:
        silent.close()
        slow.close()
    # Ordinary requests are unaffected.
    assert local_server.get_json("/health")[0] == 200


def test_client_disconnect_logs_one_info_line(local_server):
    aborts = f'vllm:request_success_total{{finished_reason="abort",model_name="{SERVED_NAME}"}}'
    before = local_server.metrics().get(aborts, 0)
    log_start = local_server.log.stat().st_size
    payload = json.dumps(
        {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", local_server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    deadline = time.monotonic() + 60
    while local_server.metrics()[f"vllm:num_requests_running{M}"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 60
    while local_server.metrics().get(aborts, 0) <= before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.1)
    time.sleep(1.0)  # let the handler finish and log
    with open(local_server.log, "rb") as f:
        f.seek(log_start)
        new = f.read().decode("utf-8", "replace")
    assert "disconnected; aborted 1 request(s)" in new, new
    assert "CancelledError" not in new and "Traceback" not in new, new
    assert "ERROR" not in new, new


# -- metrics ----------------------------------------------------------------------------


def test_metrics_use_vllm_names(local_server, client):
    client.completions.create(model=SERVED_NAME, prompt="Hi there", max_tokens=5, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(local_server.metrics_text())}
    for name, kind in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:time_per_output_token_seconds", "histogram"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("tensorstream_model_load_bytes", "gauge"),
        ("tensorstream_model_load_gb_per_second", "gauge"),
        ("tensorstream_model_load_mapped_bytes", "gauge"),
        ("tensorstream_http_requests", "counter"),
    ]:
        assert families[name].type == kind, name
    m = local_server.metrics()
    assert m[f"vllm:prompt_tokens_total{M}"] > 0
    assert m[f"vllm:generation_tokens_total{M}"] >= 5
    assert m['vllm:request_success_total{finished_reason="length",model_name="smol"}'] >= 1
    assert m[f"vllm:e2e_request_latency_seconds_count{M}"] >= 1
    assert m[f"vllm:inter_token_latency_seconds_count{M}"] >= 4
    assert m[f"vllm:time_per_output_token_seconds_count{M}"] >= 1
    assert m["tensorstream_model_load_bytes"] > 100e6
    if cpu_matmul_supported(torch.bfloat16):
        # A mapped local load reads (almost) nothing: no throughput is claimed (issue #16).
        assert m["tensorstream_model_load_gb_per_second"] < 0.01
        assert m["tensorstream_model_load_mapped_bytes"] > 0.9 * m["tensorstream_model_load_bytes"]
    else:  # auto computes the bf16 file in float32 here (engine/cpu_dtype.py): a read
        assert m["tensorstream_model_load_gb_per_second"] > 0.01
        assert m["tensorstream_model_load_mapped_bytes"] < 0.01 * m["tensorstream_model_load_bytes"]
    assert m['tensorstream_http_requests_total{path="/v1/completions",status="200"}'] >= 1
