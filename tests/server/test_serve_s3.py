"""The guide's exact command, served straight from S3 (SeaweedFS), and a graceful SIGTERM."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from serveproc import ServeProcess

from tensorstream.engine import SamplingParams

EXTRA = '{"deserialization_kwargs": {"num_readers": 2}}'


@pytest.fixture(scope="module")
def s3_serve(guide_bucket, s3_env_vars, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-s3") / "serve.log"
    # vllm serve s3://my-bucket/vllm/facebook/opt-125m/v1 --load-format tensorizer
    #   --enable-lora --model-loader-extra-config '{"deserialization_kwargs": {"num_readers": 2}}'
    args = [guide_bucket, "--load-format", "tensorizer", "--enable-lora"]
    args += ["--model-loader-extra-config", EXTRA]
    server = ServeProcess.start(args, log, env=s3_env_vars)
    try:
        yield server
    finally:
        server.stop()


def test_guide_command_serves_from_s3(s3_serve, guide_bucket, reference_llm):
    import openai

    assert guide_bucket == "s3://my-bucket/vllm/facebook/opt-125m/v1"
    client = openai.OpenAI(
        base_url=s3_serve.base_url + "/v1", api_key="unused", max_retries=0, timeout=180
    )
    assert [m.id for m in client.models.list().data] == [guide_bucket]
    prompt = "The capital of France is"
    out = client.completions.create(model=guide_bucket, prompt=prompt, temperature=0, max_tokens=8)
    expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert out.choices[0].text == expected[0].outputs[0].text
    log = s3_serve.log.read_text()
    assert "ready:" in log and "GB/s" in log and guide_bucket in log
    assert s3_serve.metrics()["tensorstream_model_load_bytes"] > 100e6
    assert 503 in [s for s, _ in s3_serve.health_seen]


def test_sigterm_finishes_running_requests_and_exits_0(s3_serve, guide_bucket):
    body = json.dumps(
        {
            "model": guide_bucket,
            "prompt": "Count to a hundred:",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        s3_serve.base_url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    events: list[str] = []
    first = threading.Event()
    failure: list[BaseException] = []

    def read() -> None:
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                for line in resp:
                    line = line.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(300), "no first chunk"
    code = s3_serve.terminate(timeout=120)
    reader.join(timeout=60)
    assert not failure, failure
    assert code == 0, s3_serve.log.read_text()[-3000:]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # Every token arrived although the server was told to stop mid-stream.
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    # Once stopped, nothing listens any more.
    time.sleep(0.5)
    assert s3_serve.get_json("/health", timeout=2)[0] == 0
