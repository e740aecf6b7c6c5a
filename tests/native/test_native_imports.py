"""The hot path imports neither transformers nor peft for Llama-family models.

Checked in fresh interpreters: ``LLM(...)`` -> generate/chat (``sys.modules``; and
``from tensorstream import LLM`` imports no torch, so the weight fetch starts first), and
``tensorstream serve`` -> ready (``python -X importtime`` lists every module imported).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HEAVY = ("transformers", "peft")

_LLM_SCRIPT = """
import json, sys
from tensorstream import LLM, SamplingParams
from tensorstream.engine import LLM, SamplingParams
# Nothing imported so far needs torch: LLM() starts the weight fetch before importing it.
torch_at_import = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
llm = LLM(sys.argv[1], device="cpu")
out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))
llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2))
print(json.dumps({
    "impl": llm.model_impl,
    "text": out[0].outputs[0].text,
    "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "peft")),
    "dynamo": "torch._dynamo" in sys.modules,
    "torch_at_import": torch_at_import,
    "torch_after_load": "torch" in sys.modules,
}))
"""


def _run_llm(model: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _LLM_SCRIPT, model],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_llm_hot_path_imports_no_transformers(smollm2_dir, tiny):
    result = _run_llm("smollm2-135m")
    assert result["impl"] == "native" and result["text"]
    assert result["heavy"] == []
    # Regression: default init of the meta embedding (normal_) imported torch._dynamo,
    # seconds of a cold start; the native modules skip init altogether.
    assert result["dynamo"] is False
    # Regression: importing tensorstream (or its engine) imported torch, so no weight
    # fetch could start before torch's seconds-long import.
    assert result["torch_at_import"] == [] and result["torch_after_load"] is True
    # The same script on a model the native code does not cover does import transformers,
    # so the check above can fail.
    import transformers

    config = transformers.AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=4, n_positions=64, vocab_size=49152
    )
    other = tiny("llama").parent / "tiny-gpt2-imports"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (other / name).write_bytes((smollm2_dir / name).read_bytes())
    fallback = _run_llm(str(other))
    assert fallback["impl"] == "transformers" and "transformers" in fallback["heavy"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_until_ready_imports_no_transformers(smollm2_dir, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "tensorstream", "serve", "smollm2-135m",
             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
            stdout=subprocess.DEVNULL, stderr=err, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    ready = r.status == 200
                    break
            except OSError:
                time.sleep(0.5)
        assert ready, log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    imported = {
        line.split("|")[-1].strip()
        for line in log.read_text().splitlines()
        if line.startswith("import time:")
    }
    assert "tensorstream.engine.native_core" in imported  # importtime really listed our path
    assert not [m for m in imported if m.split(".")[0] in HEAVY]
