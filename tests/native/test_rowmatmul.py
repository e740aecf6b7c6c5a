"""The AMX small-batch matmul (``engine/models/rowmatmul.py``): oneDNN's bits, from its
own packed weights, and the engine's outputs unchanged with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tensorstream.engine.models import rowmatmul, rowops
from tensorstream.engine.models.packing import FusedLinear

#: (outputs, inputs) of the supported families' layers: SmolLM2 (q/k/v 960, gate/up 3072,
#: down, head), TinyLlama-shaped (2048, 5632, k/v 256), Qwen2.5-0.5B (896, 4864, 1152).
SHAPES = [
    (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
    (2560, 2048), (11264, 2048), (2048, 5632),
    (1152, 896), (9728, 896), (896, 4864),
]  # fmt: skip


def _amx_host() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags and " amx_tile" in flags


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel(one_thread):
    if not rowmatmul.active():
        pytest.skip("no AMX (or no C compiler) here: oneDNN's matmul runs, tested elsewhere")


def _fused(outputs: list[int], inputs: int, bias: bool = False) -> FusedLinear:
    generator = torch.Generator().manual_seed(outputs[0] * 7 + inputs)
    layers = []
    for n in outputs:
        layer = nn.Linear(inputs, n, bias=bias, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, inputs, generator=generator))
            if bias:
                layer.bias.copy_(torch.randn(n, generator=generator))
        layer.requires_grad_(False)
        layers.append(layer)
    fused = FusedLinear.build(layers)
    if fused is None:
        pytest.skip("oneDNN does not pack bfloat16 here")
    return fused


def _onednn(x: torch.Tensor, fused: FusedLinear) -> torch.Tensor:
    """oneDNN's packed matmul as the engine runs it: 1-2 rows padded to 4 (PAD_BELOW)."""
    rows = x.shape[0]
    if rows < 3:
        x = torch.cat([x, x[:1].expand(4 - rows, -1)])
    out = torch.ops.mkldnn._linear_pointwise(x, fused.packed, fused.bias, "none", [], "")
    return out[:rows]


def test_the_kernel_runs_exactly_where_amx_is(one_thread):
    expected = _amx_host() and rowops.library() is not None
    assert rowmatmul.active() == expected


@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
def test_bits_equal_onednn_for_1_to_32_rows(kernel, outputs, inputs):
    fused = _fused([outputs], inputs)
    x = torch.randn(rowmatmul.MAX_ROWS, inputs).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 7, 16, 17, 25, 32):
        got = rowmatmul.matmul(x[:rows], fused)
        assert got is not None
        assert torch.equal(got, _onednn(x[:rows], fused)), f"{rows} rows"


def test_joined_layers_and_biases_equal_onednn(kernel):
    fused = _fused([576, 192, 192], 576, bias=True)  # q, k, v with Qwen2's biases
    x = torch.randn(9, 576).to(torch.bfloat16)
    got = rowmatmul.matmul(x, fused)
    assert got is not None and got.shape == (9, 960)
    assert torch.equal(got, _onednn(x, fused))
    plain = torch.cat(
        [nn.functional.linear(x, layer.weight, layer.bias) for layer in fused.layers], 1
    )
    assert torch.equal(got, plain)


def test_a_row_gets_its_bits_alone_or_among_others(kernel):
    fused = _fused([3072], 576)
    x = torch.randn(32, 576).to(torch.bfloat16)
    full = rowmatmul.matmul(x, fused)
    for row in (0, 5, 16, 31):
        assert torch.equal(rowmatmul.matmul(x[row : row + 1], fused), full[row : row + 1])


def test_strided_rows_are_read_at_their_stride(kernel):
    fused = _fused([960], 576)
    wide = torch.randn(6, 1152).to(torch.bfloat16)
    x = wide[:, 576:]  # rows 1152 apart
    assert torch.equal(rowmatmul.matmul(x, fused), _onednn(x.contiguous(), fused))


def test_what_it_does_not_take_goes_to_onednn(kernel):
    fused = _fused([960], 576)
    x = torch.randn(rowmatmul.MAX_ROWS + 1, 576).to(torch.bfloat16)
    assert rowmatmul.matmul(x, fused) is None  # above MAX_ROWS oneDNN blocks its sums otherwise
    assert rowmatmul.matmul(x[:0], fused) is None
    assert rowmatmul.matmul(x[:4].float(), fused) is None
    odd = _fused([48], 576)  # outputs not a multiple of 32
    assert rowmatmul.Plan.build(odd) is None
    assert rowmatmul.matmul(x[:4], odd) is None


def test_a_layout_it_does_not_know_is_refused(kernel):
    fused = _fused([960], 576)
    with torch.no_grad():
        fused.layers[0].weight[-1, -1] += 1  # the packed copy no longer matches its weight
    assert rowmatmul.Plan.build(fused) is None


def test_two_threads_split_the_outputs_and_keep_the_bits(kernel):
    fused = _fused([3072], 576)
    x = torch.randn(16, 576).to(torch.bfloat16)
    alone = rowmatmul.matmul(x, fused)
    torch.set_num_threads(2)
    assert rowmatmul.threads() == 2
    for _ in range(3):  # the helper thread woken from sleep and while it spins
        assert torch.equal(rowmatmul.matmul(x, fused), alone)
    assert torch.equal(alone, _onednn(x, fused))


def test_more_compute_threads_keep_onednn(kernel):
    fused = _fused([960], 576)
    torch.set_num_threads(rowmatmul.MAX_THREADS + 1)
    assert not rowmatmul.active()
    assert rowmatmul.matmul(torch.randn(4, 576).to(torch.bfloat16), fused) is None


def test_switched_off_it_never_runs(kernel, monkeypatch):
    monkeypatch.setattr(rowmatmul, "ENABLED", False)
    fused = _fused([960], 576)
    assert rowmatmul.matmul(torch.randn(4, 576).to(torch.bfloat16), fused) is None


def test_engine_outputs_are_the_same_with_and_without_it(kernel, smollm2_dir, monkeypatch):
    """Staggered bf16 requests on the real SmolLM2: every token and logprob equal with the
    kernel and with oneDNN alone, and the kernel really ran (decode steps and the head)."""
    from tensorstream.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_dir), dtype="bfloat16", model_impl="native", cpu_threads=1)
    lib = rowops.library()
    real, calls = lib.matmul, []

    def counted(*args):
        calls.append(args[4])  # outputs
        return real(*args)

    monkeypatch.setattr(lib, "matmul", counted)
    prompts = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for enabled in (True, False, True):
        monkeypatch.setattr(rowmatmul, "ENABLED", enabled)
        calls.clear()
        outs = llm.generate(prompts, params)
        runs.setdefault(enabled, []).append(
            [
                (o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                for o in outs
            ]
        )
        assert bool(calls) == enabled
        if enabled:
            assert llm.model.config.vocab_size in calls  # the LM head too
    assert runs[True][0] == runs[True][1] == runs[False][0]


@pytest.mark.parametrize(
    ("arch", "threads"),
    [("builtin", 1), ("builtin", 2), ("qwen2", 1), ("qwen3", 1), ("mistral", 1)],
)
def test_decode_steps_in_one_call_give_the_python_pass_bits(
    kernel, arch, threads, tiny, smollm2_dir, monkeypatch
):
    """``DecodeStack`` (a decode step's layers as one C call) against the Python lean pass
    it replaces: every token and logprob equal, staggered arrivals included, and the C
    call really ran. Qwen2 has biases, Qwen3 q/k norms; two threads split the matmuls."""
    from tensorstream.engine import LLM, SamplingParams

    model_dir = smollm2_dir if arch == "builtin" else tiny(arch)
    llm = LLM(str(model_dir), dtype="bfloat16", model_impl="native", cpu_threads=threads)
    lib = rowops.library()
    real, rows = lib.decode_stack, []

    def counted(*args):
        rows.append(args[1])
        return real(*args)

    monkeypatch.setattr(lib, "decode_stack", counted)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run() -> list:
        core = llm.engine
        ids = [llm.tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3,", "Hi")]
        finished, step = {}, 0
        requests = {}
        while step < 2 or core.has_unfinished_requests():
            if step < len(ids):  # one new request per step: prompt rows beside decode rows
                requests[core.add_request(ids[step], params)] = step
            for out in core.step():
                if out.finished:
                    done = out.outputs[0]
                    finished[requests[out.request_id]] = (
                        done.token_ids,
                        [sorted((t, p.logprob) for t, p in d.items()) for d in done.logprobs],
                    )
            step += 1
        return [finished[i] for i in range(len(ids))]

    run()  # packs the layers (the lean pass needs them all packed)
    monkeypatch.setattr(rowmatmul, "STACK", False)
    rows.clear()
    python_pass = run()
    assert not rows
    monkeypatch.setattr(rowmatmul, "STACK", True)
    assert run() == python_pass
    assert rows and max(rows) == 3  # decode-only steps of up to all three requests
