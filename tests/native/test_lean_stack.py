"""The lean engine pass (``engine/models/fastpath.py``): the module path's bits, run only
where skipping the modules changes nothing."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine import LLM, SamplingParams
from tensorstream.engine.cpu_dtype import cpu_matmul_supported
from tensorstream.engine.models import fastpath, llama, packing

pytestmark = pytest.mark.usefixtures("row_operators")

PROMPTS = [
    [1, 504, 3458, 5, 906, 42, 17],
    [7],
    list(range(100, 160)),
    [31, 9, 2860],
]

#: The dtype this CPU packs (``packing.packed_dtype``): bf16 where its matmuls are fast
#: (AVX-512/AMX), float32 elsewhere (AVX2). The lean pass needs packed layers.
DTYPE = "bfloat16" if cpu_matmul_supported(torch.bfloat16) else "float32"
needs_packing = pytest.mark.skipif(
    not packing.pack_enabled(torch.zeros(8, 4, dtype=getattr(torch, DTYPE))),
    reason="this torch build has no oneDNN packing",
)


def _generate(llm, lean: bool, prompts=PROMPTS, max_tokens=12):
    """Token ids and top-3 logprobs of each prompt, all in one batch."""
    fastpath.ENABLED = lean
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        fastpath.ENABLED = True
    return [
        (o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.fixture
def runs(monkeypatch):
    """How many times the lean pass ran."""
    count = [0]
    inner = fastpath.LeanStack.run

    def counted(self, *args, **kwargs):
        count[0] += 1
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(fastpath.LeanStack, "run", counted)
    return count


@needs_packing
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),  # q/k/v biases
        ("qwen3", {}),  # q/k norms
        ("mistral", {"sliding_window": 12}),  # masked decode attention
    ],
)
def test_lean_pass_gives_the_module_path_bits(tiny, runs, arch, overrides):
    llm = LLM(str(tiny(arch, **overrides)), device="cpu", dtype=DTYPE)
    module_path = _generate(llm, lean=False)
    assert runs[0] == 0
    assert _generate(llm, lean=True) == module_path
    assert runs[0] > 0


@needs_packing
def test_padded_small_batches_keep_the_bits(tiny, runs, monkeypatch):
    """Where the CPU pads small batches (``llama.padded_rows``), the lean pass pads alike."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype=DTYPE)
    monkeypatch.setattr(llama, "padded_rows", lambda rows, dtype, packed=False: max(rows, 4))
    alone = [_generate(llm, lean=False, prompts=[p]) for p in PROMPTS[:2]]
    assert [_generate(llm, lean=True, prompts=[p]) for p in PROMPTS[:2]] == alone
    assert runs[0] > 0


@needs_packing
def test_hooks_and_written_weights_take_the_module_path(tiny, runs):
    """A forward hook must fire (tensor parallelism's all-reduce is one), and a weight
    written in place must be used: both send the pass through the modules."""
    llm = LLM(str(tiny("llama")), device="cpu", dtype=DTYPE)
    before = _generate(llm, lean=True)
    fired = []
    o_proj = llm.model.model.layers[1].self_attn.o_proj
    handle = o_proj.register_forward_hook(lambda *_: fired.append(1))
    used = runs[0]
    try:
        assert _generate(llm, lean=True) == before
    finally:
        handle.remove()
    assert fired and runs[0] == used
    with torch.no_grad():
        llm.model.model.layers[0].mlp.up_proj.weight.mul_(-2.0)
        llm.model.model.layers[1].post_attention_layernorm.weight.mul_(3.0)
    changed = _generate(llm, lean=True)
    assert changed != before
    assert changed == _generate(llm, lean=False)
    assert runs[0] > used  # rebuilt over the new packed weights


def test_staggered_float32_requests_equal_alone_with_a_window(tiny):
    """float32 decode attention (batched matmuls, a sliding-window mask) under continuous
    batching: requests joining and leaving mid-flight get exactly their solo tokens."""
    llm = LLM(str(tiny("mistral", sliding_window=12)), device="cpu", dtype="float32")
    max_tokens = [9, 30, 5, 11]
    alone = [_generate(llm, True, [p], m)[0][0] for p, m in zip(PROMPTS, max_tokens, strict=True)]
    core, ids, got, step = llm.engine, {}, {}, 0
    arrivals = {0: [0, 1], 2: [2], 3: [3]}
    while arrivals or core.has_unfinished_requests():
        for i in arrivals.pop(step, []):
            params = SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True)
            ids[core.add_request(PROMPTS[i], params)] = i
        for out in core.step():
            if out.finished:
                got[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
    assert [got[i] for i in range(len(PROMPTS))] == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolled_rotation_has_the_bits_of_rotate_half(dtype):
    from tensorstream.engine.models.rope import rotate, rotate_rolled, signed_sin

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, 3, 64, generator=generator).to(dtype)
    angles = torch.randn(5, 3, 64, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rolled = rotate_rolled(x, cos[:, None], signed_sin(sin)[:, None])
    assert torch.equal(rolled, rotate(x, cos, sin))
