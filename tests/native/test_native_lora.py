"""LoRA on the native model code: logits and tokens equal PEFT's, adapters mixed per row."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.lora import LoRARequest
from tensorstream.errors import ConfigError

try:  # tests/ as a package
    from tests.tiny_models import make_peft_adapter
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import make_peft_adapter

PROMPT = [1, 504, 3458, 5, 906, 42, 17]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    base = tiny("qwen2")  # biases in q/k/v: the low-rank update adds to a biased output
    root = tmp_path_factory.mktemp("native-lora")
    adapters = {
        "attn": make_peft_adapter(base, root / "attn", TARGETS["attn"], 4, 1),
        "mlp": make_peft_adapter(base, root / "mlp", TARGETS["mlp"], 8, 2, use_rslora=True),
    }
    return base, adapters


def _peft(base, adapter):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0]
        out = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False
        )
    return logits, out[0, len(PROMPT) :].tolist()


def test_native_lora_equals_peft_mixed_in_one_batch(setup):
    base, adapters = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2)
    assert llm.model_impl == "native"
    requests = {k: LoRARequest(k, i + 1, str(p)) for i, (k, p) in enumerate(adapters.items())}
    expected = {k: _peft(base, p) for k, p in adapters.items()}
    expected[None] = _peft(base, None)
    for key, request in requests.items():
        name = llm.lora_manager.add(request)
        with torch.no_grad(), llm.lora_manager.activate([name]):
            logits = llm.model(input_ids=torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(logits, expected[key][0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected["attn"][0], expected[None][0], atol=1e-3)
    order = ["attn", None, "mlp", "attn", None]
    prompts = [{"prompt_token_ids": PROMPT}] * len(order)
    loras = [requests[k] if k else None for k in order]
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == [expected[k][1] for k in order]
    assert "peft" not in type(llm.lora_manager).__module__


def test_native_lora_refuses_adapters_it_cannot_apply(setup, tiny, tmp_path):
    base, adapters = setup
    other = LLM(str(tiny("llama", hidden_size=48)), device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="does not fit this model"):
        other.add_lora(LoRARequest("attn", 1, str(adapters["attn"])))
    assert other.list_loras() == set()
    biased = make_peft_adapter(base, tmp_path / "biased", ["q_proj"], 4, 3, bias="lora_only")
    llm = LLM(str(base), device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="trains biases"):
        llm.add_lora(LoRARequest("biased", 1, str(biased)))
    with pytest.raises(ConfigError, match="enable_lora"):
        LLM(str(base), device="cpu").generate(
            {"prompt_token_ids": PROMPT}, GREEDY, lora_request=LoRARequest("a", 1, "/x")
        )
