"""Step-level continuous batching: every request gets exactly the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.errors import ConfigError

pytestmark = pytest.mark.usefixtures("row_operators")

# Prompts of very different lengths, so batched decode rows sit at different positions.
PROMPTS = [
    [1, 504, 3458, 5, 906, 42, 17],
    [7],
    list(range(100, 160)),
    [31, 9, 2860],
    list(range(2000, 2023)),
]


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny("llama")), device="cpu", dtype="float32")


def _alone(llm, prompt, n_tokens):
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


def _drive(core, arrivals, max_tokens):
    """Add requests at the given steps (arrivals: step -> prompts) and step to the end."""
    finished, step, ids = {}, 0, {}
    while arrivals or core.has_unfinished_requests():
        for prompt_index in arrivals.pop(step, []):
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens[prompt_index], ignore_eos=True
            )
            ids[core.add_request(PROMPTS[prompt_index], params)] = prompt_index
        for out in core.step():
            if out.finished:
                finished[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
    return finished


@pytest.mark.parametrize("chunk", [512, 5])
def test_staggered_arrivals_equal_alone(llm, chunk):
    max_tokens = [9, 14, 5, 11, 7]
    alone = [_alone(llm, p, m) for p, m in zip(PROMPTS, max_tokens, strict=True)]
    llm.engine.chunk = chunk  # small chunks: long prompts prefill over several steps
    try:
        got = _drive(llm.engine, {0: [0, 1], 2: [2], 3: [3], 6: [4]}, max_tokens)
    finally:
        llm.engine.chunk = 512
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_every_running_request_advances_every_step(llm):
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = core.add_request(PROMPTS[0], params)
    assert {o.request_id for o in core.step()} == {first}
    second = core.add_request(PROMPTS[2], params)
    # The running request decodes and the new one gets its first token in the same step.
    outs = {o.request_id: o for o in core.step()}
    assert set(outs) == {first, second}
    assert len(outs[first].outputs[0].token_ids) == 2
    assert len(outs[second].outputs[0].token_ids) == 1
    while core.has_unfinished_requests():
        core.step()


def test_long_prompt_does_not_stall_running_decodes(llm):
    core = llm.engine
    core.chunk = 8
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        running = core.add_request(PROMPTS[0], params)
        core.step()
        core.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=2))
        # The 60-token prompt takes 8 steps of 8-token chunks; the running request
        # still gains one token in each of them.
        for expected in range(2, 10):
            outs = {o.request_id: o for o in core.step()}
            assert len(outs[running].outputs[0].token_ids) == expected
    finally:
        core.chunk = 512
        while core.has_unfinished_requests():
            core.step()


def test_n_completions_and_abort(llm):
    core = llm.engine
    alone = _alone(llm, PROMPTS[3], 8)
    params = SamplingParams(temperature=0, max_tokens=8, n=3, ignore_eos=True)
    keep = core.add_request(PROMPTS[3], params)
    drop = core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    core.step()
    core.step()
    core.abort_request(drop)
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.request_id != drop
            if out.finished:
                finished[out.request_id] = out
    assert [c.token_ids for c in finished[keep].outputs] == [alone] * 3
    assert len(core._rows) == 0  # every cache row was released


def test_seeded_sampling_is_reproducible_in_a_batch(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert batch[0].outputs[0].token_ids == alone


def test_penalties_logprobs_and_stop_strings(llm):
    text = llm.tokenizer.decode(_alone(llm, PROMPTS[0], 6))
    stop = text[3:6]
    params = SamplingParams(temperature=0, max_tokens=6, stop=stop, logprobs=2)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and out.text == text[: text.index(stop)]
    assert all(len(step) >= 2 for step in out.logprobs)
    penalised = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=5.0)
    tokens = llm.generate({"prompt_token_ids": [7]}, penalised)[0].outputs[0].token_ids
    assert len(set(tokens)) == len(tokens)  # a steep penalty forbids every repeat


def test_bf16_batched_equals_alone(tiny):
    llm = LLM(str(tiny("qwen2")), device="cpu", dtype="bfloat16")
    alone = [_alone(llm, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in batch] == alone


def test_kv_cache_grows_past_its_first_length(tiny):
    llm = LLM(str(tiny("llama")), device="cpu", max_model_len=256)
    first_length = llm.engine.cache.length
    prompt = list(range(300, 300 + first_length - 2))
    got = _alone(llm, prompt, 10)
    assert llm.engine.cache.length > first_length
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny("llama"))
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10
        )
    assert got == out[0, len(prompt) :].tolist()


def test_bad_chunk_size_is_refused(tiny):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(str(tiny("llama")), device="cpu", max_num_batched_tokens=-1)


def test_smollm2_bf16_alone_equals_beside_others(smollm2_dir):
    """bf16 rounding must not depend on the other rows: a request decoding beside another
    gets exactly its solo tokens (regression: one-row GEMV vs GEMM, masked SDPA width)."""
    llm = LLM("smollm2-135m", device="cpu")
    first = llm.tokenizer("The capital of France is")["input_ids"]
    second = llm.tokenizer("def fibonacci(n):")["input_ids"]
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = _alone(llm, first, 40)
    for join in (1, 3):
        core = llm.engine
        request = core.add_request(first, long_params)
        done, step = {}, 0
        while core.has_unfinished_requests():
            if step == join:
                core.add_request(second, SamplingParams(temperature=0, max_tokens=12))
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
        assert done[request] == alone


def _padded_bias(positions: list[int], window: int | None = None) -> torch.Tensor:
    from tensorstream.engine.kvcache import padded_length

    pos = torch.tensor(positions)
    keys = torch.arange(padded_length(max(positions) + 1))
    visible = keys[None, :] <= pos[:, None]
    if window is not None:
        visible &= keys[None, :] > pos[:, None] - window
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return bias[:, None, None]


@pytest.mark.parametrize("window", [None, 37])
def test_padded_decode_attention_gives_each_row_its_own_bits(tiny, window):
    """One bf16 attention call over rows of different lengths: every row's output equals the
    row attended alone, bit for bit, and SDPA over exactly its keys within bf16 rounding."""
    import torch.nn.functional as F

    from tensorstream.engine.kvcache import KEY_BLOCK

    llm = LLM(str(tiny("llama")), device="cpu", dtype="bfloat16")
    attention = llm.model.model.layers[0].self_attn
    heads, kv, d = attention.heads, attention.kv_heads, attention.head_dim
    generator = torch.Generator().manual_seed(3)
    rows, length = 9, 4 * KEY_BLOCK
    keys = torch.randn(rows, kv, length, d, generator=generator).bfloat16()
    values = torch.randn(rows, kv, length, d, generator=generator).bfloat16()
    q = torch.randn(rows, heads, 1, d, generator=generator).bfloat16()
    positions = [0, 5, 63, 64, 100, 191, 200, 255, 17]  # block edges and ragged lengths
    bias = attention.head_bias(_padded_bias(positions, window))
    together = attention._attend_padded(q, keys, values, 0, rows, bias)
    for r, pos in enumerate(positions):
        alone = attention._attend_padded(
            q[r : r + 1], keys, values, r, r + 1, attention.head_bias(_padded_bias([pos], window))
        )
        assert torch.equal(alone, together[r : r + 1]), f"row {r} (position {pos})"
        first = 0 if window is None else max(0, pos - window + 1)
        reference = F.scaled_dot_product_attention(
            q[r : r + 1].float(),
            keys[r : r + 1, :, first : pos + 1].float().repeat_interleave(heads // kv, 1),
            values[r : r + 1, :, first : pos + 1].float().repeat_interleave(heads // kv, 1),
        )
        torch.testing.assert_close(alone.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_bf16_staggered_arrivals_equal_alone(tiny, arch):
    """The padded bf16 decode path under continuous batching (a sliding window included):
    requests joining and leaving mid-flight get exactly their solo tokens."""
    overrides = {"sliding_window": 12} if arch == "mistral" else {}
    llm = LLM(str(tiny(arch, **overrides)), device="cpu", dtype="bfloat16")
    max_tokens = [9, 30, 5, 11, 7]
    alone = [_alone(llm, p, m) for p, m in zip(PROMPTS, max_tokens, strict=True)]
    got = _drive(llm.engine, {0: [0, 1], 2: [2], 3: [3], 6: [4]}, max_tokens)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert llm.engine.cache.length % 64 == 0


@pytest.mark.parametrize("features", [576, 2048, 5632])
def test_linear_rows_get_the_same_bits_alone_and_in_a_batch(features):
    """One or two rows run padded (GEMV rounds differently, and oneDNN's two-row kernel is
    slower), so a row's output never depends on how many rows ran beside it."""
    from tensorstream.engine.models.llama import Linear, _linear

    generator = torch.Generator().manual_seed(features)
    layer = Linear(features, 3000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(3000, features, generator=generator))
        x = torch.randn(7, 1, features, generator=generator).bfloat16()
        together = _linear(x, layer, None, "w")
        for rows in (1, 2, 3, 5):
            alone = _linear(x[:rows], layer, None, "w")
            assert alone.shape == (rows, 1, 3000)
            assert torch.equal(alone, together[:rows]), rows
