"""Native Llama-family models equal transformers' from_pretrained: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.models import NativeConfig, build_native, read_config_json
from tensorstream.errors import ConfigError

IDS = [1, 504, 3458, 5, 906, 42, 17, 2860, 31, 9]
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village by the sea,"]
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
VARIANTS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-rope-llama3": ("llama", dict(rope_scaling=LLAMA3)),
    "llama-rope-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-rope-dynamic": ("llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "mistral": ("mistral", {}),
    "mistral-sliding-window": ("mistral", dict(sliding_window=6)),
    "qwen2-biases": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
}


def _reference(model_dir, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_greedy(model, prompt_ids, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n
        )
    return out[0, len(prompt_ids) :].tolist()


def _assert_greedy_agrees(model, prompt_ids, tokens, tolerance):
    """Each of ``tokens`` is the reference's greedy choice, teacher-forced on our tokens,
    or ties with it within ``tolerance`` (bf16 kernels differ between CPUs: on an AVX2
    host a near tie of a tiny random model can flip; the token must still be a top one)."""
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :].float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    flips = [i for i, t in enumerate(tokens) if t != int(logits[i].argmax())]
    assert all(best[i] - chosen[i] <= tolerance for i in flips), (flips, best - chosen)
    assert len(flips) <= len(tokens) // 4, flips  # near ties are rare, not the rule


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_equal_transformers(tiny, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny(arch, **overrides)
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    assert llm.model_impl == "native"
    reference = _reference(model_dir, torch.float32)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ours, theirs = llm.model(ids).logits, reference(ids).logits
    # Same op order as transformers: float32 logits agree to rounding noise.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": IDS}, greedy)[0].outputs[0].token_ids
    assert got == _hf_greedy(reference, IDS, 12)


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen2-biases"])
def test_bf16_logits_close_and_greedy_equal(tiny, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny(arch, **overrides)
    llm = LLM(str(model_dir), device="cpu", dtype="bfloat16")
    reference = _reference(model_dir, torch.bfloat16)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ours, theirs = llm.model(ids).logits.float(), reference(ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": IDS}, greedy)[0].outputs[0].token_ids
    _assert_greedy_agrees(reference, IDS, got, tolerance=2e-2)


def _own_sums() -> bool:
    """Whether bf16 matmuls here run the AVX-512 kernel, whose sums are its own."""
    from tensorstream.engine.models import rowmatmul, rowops

    lib = rowops.library()
    return lib is not None and lib.matmul_block == 64 and rowmatmul.ENABLED


def test_smollm2_logits_and_greedy_equal_transformers(smollm2_dir):
    """bf16 logits as accurate as transformers' bf16 ones, measured against its float32
    model: where our matmuls are oneDNN's they are equal, but with the AVX-512 bf16 kernel
    (no AMX) the same products are summed in another order, and bf16 noise through 30
    layers moves logits by up to ~0.9 either way (measured on a Zen 4: max error against
    float32 0.463 / 0.756 for both, mean 0.101 / 0.110 against 0.101 / 0.125)."""
    llm = LLM("smollm2-135m", device="cpu", dtype="bfloat16")  # auto may pick float32
    assert llm.model_impl == "native" and llm.model.dtype == torch.bfloat16
    reference = _reference(smollm2_dir, torch.bfloat16)
    exact = _reference(smollm2_dir, torch.float32)
    prompt = llm.tokenizer("The capital of France is")["input_ids"]
    for text in ("The capital of France is", PROMPTS[1]):
        ids = torch.tensor([llm.tokenizer(text)["input_ids"]])
        with torch.no_grad():
            ours = llm.model(ids).logits.float()
            theirs, truth = reference(ids).logits.float(), exact(ids).logits
        ours_error, their_error = (ours - truth).abs(), (theirs - truth).abs()
        assert ours_error.max() <= their_error.max() * 1.25 + 0.05, text
        assert ours_error.mean() <= their_error.mean() * 1.25 + 0.01, text
        if not _own_sums():  # oneDNN's sums (or AMX's, which are oneDNN's): close to theirs
            torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=5e-2)
    got = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0]
    assert got.token_ids == _hf_greedy(reference, prompt, 10)
    assert "Paris" in got.text


def test_checkpoint_with_rotary_inv_freq_loads(tiny, tmp_path):
    """Older checkpoints saved rotary ``inv_freq``; it is ignored and recomputed."""
    model_dir = tiny("llama", rope_scaling=dict(rope_type="linear", factor=2.0))
    weights = load_file(model_dir / "model.safetensors")
    bogus = torch.full((4,), 123.0)
    weights["model.rotary_emb.inv_freq"] = bogus
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = bogus.clone()
    config = NativeConfig.from_dict(read_config_json(model_dir))
    model = build_native(config, weights, dtype=torch.float32, device="cpu")
    reference = _reference(model_dir, torch.float32)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    save_file(weights, tmp_path / "model.safetensors")  # the LLM path too
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.model_impl == "native"
    assert torch.equal(llm.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_other_architectures_fall_back_and_opt_out(tiny, tmp_path, caplog):
    import logging

    model_dir = tiny("llama")
    with caplog.at_level(logging.INFO, logger="tensorstream.engine.llm"):
        forced = LLM(str(model_dir), device="cpu", model_impl="transformers")
    assert forced.model_impl == "transformers"
    assert type(forced.model).__module__.startswith("transformers.")
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert loaded and "transformers model code" in loaded[-1]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    native = LLM(str(model_dir), device="cpu")
    assert (
        native.generate(PROMPTS, greedy)[1].outputs[0].token_ids
        == forced.generate(PROMPTS, greedy)[1].outputs[0].token_ids
    )
    with pytest.raises(ConfigError, match="model_impl"):
        LLM(str(model_dir), device="cpu", model_impl="tensorflow")


def test_native_required_for_unsupported_architecture_is_refused(tmp_path, smollm2_dir):
    import transformers

    config = transformers.AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=4, n_positions=64, vocab_size=49152
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu", model_impl="native")
    assert LLM(str(tmp_path), device="cpu").model_impl == "transformers"


def test_architecture_selection_from_config_json():
    from tensorstream.engine.models import native_architecture

    base = dict(
        hidden_size=8,
        num_attention_heads=2,
        vocab_size=10,
        intermediate_size=4,
        num_hidden_layers=1,
    )
    assert native_architecture({**base, "architectures": ["LlamaForCausalLM"]}) == "llama"
    assert native_architecture({**base, "architectures": ["Qwen2ForCausalLM"]}) == "qwen2"
    assert native_architecture({**base, "architectures": ["OPTForCausalLM"]}) is None
    assert native_architecture({**base}) is None  # no architectures: transformers decides
    # What the native code does not implement goes to transformers, not to a wrong answer.
    yarn = {"rope_type": "yarn", "factor": 4.0}
    llama = {**base, "architectures": ["LlamaForCausalLM"]}
    assert native_architecture({**llama, "rope_scaling": yarn}) is None
    assert native_architecture({**llama, "hidden_act": "gelu"}) is None
    windowed = {"use_sliding_window": True, "sliding_window": 16}
    assert native_architecture({**base, "architectures": ["Qwen2ForCausalLM"], **windowed}) is None
    assert native_architecture({**llama, "num_hidden_layers": 0}) is None
