"""LLM end to end: greedy tokens equal transformers' generate, for tiny models and SmolLM2."""

from __future__ import annotations

import logging

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.cpu_dtype import cpu_matmul_supported

PROMPTS = ["The quick brown fox", "Once upon a time, in a small village by the sea,"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def hf_greedy(model_dir, prompts, max_new_tokens, dtype=None):
    """Reference tokens: from_pretrained + generate(do_sample=False), one left-padded batch.

    Rows are cut after their first EOS (transformers pads finished rows), as the engine stops there.
    """
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
    width = batch["input_ids"].shape[1]
    rows = [row[width:].tolist() for row in out]
    eos = tokenizer.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


@pytest.mark.parametrize("arch", ["opt", "llama", "gpt2", "qwen2"])
def test_greedy_matches_transformers(tiny_model, arch):
    model_dir = tiny_model(arch)
    llm = LLM(str(model_dir), load_format="safetensors", device="cpu")
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in batched] == hf_greedy(model_dir, PROMPTS, 8)
    # Alone (no padding) each prompt must match an unpadded transformers run too.
    single = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    assert single.token_ids == hf_greedy(model_dir, PROMPTS[1:], 8)[0]
    assert single.finish_reason == "length" and len(single.token_ids) == 8
    assert single.text == llm.tokenizer.decode(single.token_ids, skip_special_tokens=True)


def test_builtin_smollm2_greedy_and_chat(smollm2_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tensorstream.engine.llm"):
        llm = LLM("smollm2-135m", device="cpu")
    assert llm.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert llm.load_format == "safetensors"
    stats = llm.load_stats
    assert stats.bytes > 250e6 and stats.read_seconds > 0 and stats.build_seconds > 0
    load_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert len(load_lines) == 1 and "GB/s" in load_lines[0] and "build" in load_lines[0]
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    # auto: the checkpoint's bf16, or float32 on a CPU without fast bf16 matmuls
    fast_bf16 = cpu_matmul_supported(torch.bfloat16)
    assert llm.model.dtype == (torch.bfloat16 if fast_bf16 else torch.float32)

    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5))
    assert (
        outs[0].outputs[0].token_ids == hf_greedy(smollm2_dir, ["The capital of France is"], 5)[0]
    )
    assert "Paris" in outs[0].outputs[0].text

    answer = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=12)
    )
    prompt_ids = outs and answer[0].prompt_token_ids
    # The chat template opens the assistant turn; the model answers with text, not a new turn.
    assert llm.tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    assert "4" in answer[0].outputs[0].text


def test_builtin_alias_by_hub_id(smollm2_dir):
    from tensorstream.engine import resolve_model

    for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135M"):
        location = resolve_model(name)
        assert location.files_dir == smollm2_dir and location.kind == "builtin"


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_tied_weights_stay_tied(tiny_model, arch):
    llm = LLM(str(tiny_model(arch, tie_word_embeddings=True)), device="cpu")
    embeddings = llm.model.get_input_embeddings().weight
    assert llm.model.get_output_embeddings().weight is embeddings
    assert embeddings.device.type == "cpu" and not embeddings.is_meta


def test_untied_weights_stay_separate(tiny_model):
    llm = LLM(str(tiny_model("llama", tie_word_embeddings=False)), device="cpu")
    assert llm.model.lm_head.weight.data_ptr() != llm.model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("auto", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_honoured(tiny_model, dtype, expected):
    import transformers

    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), dtype=dtype, device="cpu")
    assert {p.dtype for p in llm.model.parameters()} == {expected}
    # Non-persistent rotary buffers are recomputed exactly as from_pretrained does.
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=expected)
    assert torch.equal(llm.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    ids = torch.tensor([[5, 17, 300, 4000]])
    with torch.no_grad():
        assert torch.equal(llm.model(ids).logits, reference(ids).logits)
    if dtype == "bfloat16":
        assert (
            llm.generate(PROMPTS, GREEDY)[0].outputs[0].token_ids
            == hf_greedy(model_dir, PROMPTS, 8, dtype=torch.bfloat16)[0]
        )
