"""A request gets the same bits beside any number of others as alone, on every CPU: the
engine's row layout (``rowmatmul.Layout``, ``rowmatmul.splits_rows``) and LoRA updates
multiplied in padded pieces (``lora.BatchLoRA.apply``)."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.lora import LoRARequest
from tensorstream.engine.models import rowmatmul

try:  # tests/ as a package
    from tests.tiny_models import make_peft_adapter
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import make_peft_adapter

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
LONG = "Here is a long list of words to read: " + ", ".join(f"w{i}" for i in range(40))
PROMPTS = [f"Tell me fact number {i} about the sea." for i in range(40)] + [LONG]


def _key(output):
    done = output.outputs[0]
    return done.token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in done.logprobs]


def _together_then_alone(llm, picks=(0, 7, 23, 39, 40)):
    together = [_key(o) for o in llm.generate(PROMPTS, PARAMS)]
    alone = {i: _key(llm.generate([PROMPTS[i]], PARAMS)[0]) for i in picks}
    return together, alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_request_gets_its_bits_beside_forty_others(smollm2_dir, dtype, threads):
    """On AMX Xeons oneDNN's bf16 matmul rounds rows of calls above 32 rows otherwise: before
    the engine split its rows, 3 of 6 requests sent beside 40 others got other greedy tokens
    than alone there, and all 6 other logprobs. A fresh engine (its first passes run while
    the layers are still being packed), 40 short prompts and one long one (a chunk of its
    own: more than 32 rows), then some alone. Steps of 41 rows run here."""
    llm = LLM(str(smollm2_dir), dtype=dtype, model_impl="native", cpu_threads=threads)
    assert len(llm.tokenizer.encode(LONG)) > rowmatmul.MAX_ROWS
    together, alone = _together_then_alone(llm)
    for i, bits in alone.items():
        assert bits == together[i], f"prompt {i}"


def test_split_rows_give_the_bits_of_unsplit_ones_where_large_calls_agree(smollm2_dir, monkeypatch):
    """The split that CPUs whose large matmul calls round otherwise get (the probe forced on,
    the AMX kernel off): the same bits alone and together, and, where this CPU's large calls
    agree with 32-row pieces anyway, the very bits of the unsplit pass."""
    monkeypatch.setattr(rowmatmul, "ENABLED", False)
    llm = LLM(str(smollm2_dir), dtype="bfloat16", model_impl="native", cpu_threads=1)
    unsplit = None
    if not rowmatmul.splits_rows(torch.bfloat16, 1):
        unsplit = _together_then_alone(llm)
    segments = []
    real = rowmatmul.segmented

    def counted(x, layout, small, big):
        segments.append((x.shape[0], len(layout.big)))
        return real(x, layout, small, big)

    monkeypatch.setattr(rowmatmul, "splits_rows", lambda dtype, threads: True)
    monkeypatch.setattr(rowmatmul, "segmented", counted)
    together, alone = _together_then_alone(llm)
    for i, bits in alone.items():
        assert bits == together[i], f"prompt {i}"
    assert any(rows > rowmatmul.MAX_ROWS for rows, _ in segments)  # decode steps of 40+ rows
    assert any(big for _, big in segments)  # the long prompt's chunk in a call of its own
    if unsplit is not None:
        assert (together, alone) == unsplit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_says_split_wherever_a_large_call_rounds_otherwise(dtype):
    """Checked on SmolLM2's and TinyLlama's layer shapes, which the probe does not use."""
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(5)
    differs = False
    for outputs, inputs in ((960, 576), (3072, 576), (576, 1536), (2048, 5632)):
        weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
        x = torch.randn(100, inputs, generator=generator).to(dtype)

        def linear(rows, w=weight):
            return torch.nn.functional.linear(rows, w)

        split = rowmatmul.pieces(x, linear, packed=False)
        differs |= any(not torch.equal(linear(x[:m]), split[:m]) for m in (33, 50, 64, 100))
    assert rowmatmul.splits_rows(dtype, threads) or not differs


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_dir, tmp_path_factory):
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    out = tmp_path_factory.mktemp("lora") / "adapter"
    return make_peft_adapter(smollm2_dir, out, targets, 8, 3, std=0.05)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_lora_request_gets_its_bits_beside_others_with_its_adapter(
    smollm2_dir, smollm2_adapter, threads
):
    """Before the updates were multiplied in padded pieces, in float32 both requests with
    the adapter got other logprobs beside each other (a group of 2 rows) than alone."""
    llm = LLM(
        str(smollm2_dir), dtype="float32", model_impl="native", cpu_threads=threads,
        enable_lora=True, max_loras=2,
    )  # fmt: skip
    request = LoRARequest("sea", 1, str(smollm2_adapter))
    prompts = PROMPTS[:6]
    loras = [request, request, None, None, None, None]
    together = [_key(o) for o in llm.generate(prompts, PARAMS, lora_request=loras)]
    base_alone = _key(llm.generate([prompts[0]], PARAMS)[0])
    assert base_alone != together[0]  # the adapter changes the request
    for i in (0, 1, 2, 5):
        alone = _key(llm.generate([prompts[i]], PARAMS, lora_request=loras[i])[0])
        assert alone == together[i], f"prompt {i}"
