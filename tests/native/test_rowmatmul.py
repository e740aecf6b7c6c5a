"""The small-batch matmul (``engine/models/rowmatmul.py``) from oneDNN's own packed weights:
on AMX oneDNN's bits; with AVX-512 bf16 alone its own, defined sums (every output the
pairs of inputs added in order, as VDPBF16PS adds them), as accurate as oneDNN's; and the
engine's outputs with it."""

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


def _flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _amx_host() -> bool:
    return " amx_bf16" in _flags() and " amx_tile" in _flags()


def _avx512_bf16_host() -> bool:
    return " avx512_bf16" in _flags() and " avx512f" in _flags()


def _amx_kernel() -> bool:
    lib = rowops.library()
    return lib is not None and lib.matmul_block == 32


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel(one_thread):
    if not rowmatmul.active():
        pytest.skip("no AMX or AVX-512 bf16 (or no C compiler) here: oneDNN's matmul runs")


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


def _pair_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The AVX-512 kernel's definition, in float32 torch: per output, from zero, each pair of
    inputs added odd product first, then even (each bf16 product exact in float32, each
    sum rounded to nearest), then the bias (zeros where none), rounded to bf16."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for i in range(0, x.shape[1], 2):
        acc = acc + xf[:, i + 1 : i + 2] * wf[:, i + 1]
        acc = acc + xf[:, i : i + 1] * wf[:, i]
    acc = acc + (bias.float() if bias is not None else 0.0)
    return acc.to(torch.bfloat16)


def _expected(x: torch.Tensor, fused: FusedLinear) -> torch.Tensor:
    """The kernel's bits: oneDNN's on AMX, :func:`_pair_sums` with AVX-512 bf16 alone."""
    if _amx_kernel():
        return _onednn(x, fused)
    weight = torch.cat([layer.weight for layer in fused.layers])
    return _pair_sums(x, weight, fused.bias)


def test_the_kernel_runs_exactly_where_amx_or_avx512_bf16_is(one_thread):
    expected = (_amx_host() or _avx512_bf16_host()) and rowops.library() is not None
    assert rowmatmul.active() == expected
    if expected:
        assert rowops.library().matmul_block == (32 if _amx_host() else 64)


@pytest.mark.parametrize(("outputs", "inputs"), SHAPES)
def test_bits_for_1_to_32_rows(kernel, outputs, inputs):
    fused = _fused([outputs], inputs)
    x = torch.randn(rowmatmul.MAX_ROWS, inputs).to(torch.bfloat16)
    expected = _expected(x, fused)
    for rows in (1, 2, 3, 4, 7, 16, 17, 25, 32):
        got = rowmatmul.matmul(x[:rows], fused)
        assert got is not None
        if _amx_kernel():  # oneDNN pads 1-2 rows: its bits depend on the count
            assert torch.equal(got, _onednn(x[:rows], fused)), f"{rows} rows"
        else:
            assert torch.equal(got, expected[:rows]), f"{rows} rows"


@pytest.mark.parametrize(("outputs", "inputs"), [(3072, 576), (576, 1536), (2048, 5632)])
def test_as_accurate_as_onednn(kernel, outputs, inputs):
    """Against the float32 product, the kernel's error is oneDNN's (AVX-512: other sums of
    the same products, so other bits but the same accuracy)."""
    fused = _fused([outputs], inputs)
    x = torch.randn(16, inputs).to(torch.bfloat16)
    weight = fused.layers[0].weight
    exact = x.float() @ weight.float().T
    ours = (rowmatmul.matmul(x, fused).float() - exact).abs()
    theirs = (_onednn(x, fused).float() - exact).abs()
    assert ours.max() <= theirs.max() * 1.01
    assert ours.mean() <= theirs.mean() * 1.01


@pytest.mark.parametrize(("outputs", "inputs"), [(960, 576), (576, 1536), (49152, 576), (48, 64)])
def test_unpacked_weights_get_the_packed_bits(kernel, outputs, inputs):
    """Layers are packed over the first passes; before that ``rowmatmul.plain`` multiplies
    the checkpoint's row-major weight, and a row must get the same bits either way (on AMX
    torch's matmul already gives them and ``plain`` answers None)."""
    fused = _fused([outputs], inputs, bias=True)
    layer = fused.layers[0]
    x = torch.randn(20, inputs).to(torch.bfloat16)
    got = rowmatmul.plain(x, layer)
    if _amx_kernel():
        assert got is None
        return
    assert got is not None
    assert torch.equal(got, rowmatmul.matmul(x, fused))
    assert torch.equal(rowmatmul.plain(x[3:4], layer), got[3:4])
    odd = nn.Linear(inputs, 40, dtype=torch.bfloat16)  # outputs not a multiple of 16
    assert rowmatmul.plain(x, odd) is None
    assert rowmatmul.plain(x.float(), layer) is None


def test_unpacked_weights_with_inputs_past_whole_blocks(kernel):
    """``plain`` also takes inputs that are not a multiple of 32 (a last, partial block of
    pairs) and outputs that fill no whole 64: its sums are still the kernel's definition,
    for rows in one tile and for the rows that pack a scratch block first."""
    generator = torch.Generator().manual_seed(72)
    layer = nn.Linear(72, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 72, generator=generator))
        layer.bias.copy_(torch.randn(48, generator=generator))
    x = torch.randn(20, 72, generator=generator).to(torch.bfloat16)
    if _amx_kernel():
        assert rowmatmul.plain(x, layer) is None
        return
    for rows in (1, 5, 8, 9, 20):
        got = rowmatmul.plain(x[:rows], layer)
        assert got is not None
        assert torch.equal(got, _pair_sums(x[:rows], layer.weight, layer.bias)), rows


def test_joined_layers_and_biases_equal_onednn(kernel):
    fused = _fused([576, 192, 192], 576, bias=True)  # q, k, v with Qwen2's biases
    x = torch.randn(9, 576).to(torch.bfloat16)
    got = rowmatmul.matmul(x, fused)
    assert got is not None and got.shape == (9, 960)
    assert torch.equal(got, _expected(x, fused))
    if _amx_kernel():  # torch's own matmul gives oneDNN's bits; elsewhere the kernel's own
        parts = [nn.functional.linear(x, layer.weight, layer.bias) for layer in fused.layers]
    else:
        parts = [rowmatmul.plain(x, layer) for layer in fused.layers]
    assert torch.equal(got, torch.cat(parts, 1))


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
    assert torch.equal(rowmatmul.matmul(x, fused), _expected(x.contiguous(), fused))


def test_what_it_does_not_take_goes_to_onednn(kernel):
    fused = _fused([960], 576)
    x = torch.randn(rowmatmul.MAX_ROWS + 1, 576).to(torch.bfloat16)
    assert rowmatmul.matmul(x, fused) is None  # above MAX_ROWS oneDNN blocks its sums otherwise
    assert rowmatmul.matmul(x[:0], fused) is None
    assert rowmatmul.matmul(x[:4].float(), fused) is None
    odd = _fused([40], 576)  # outputs not a multiple of 16 (32 on AMX)
    assert rowmatmul.Plan.build(odd) is None
    assert rowmatmul.matmul(x[:4], odd) is None


def test_a_layout_it_does_not_know_is_refused(kernel):
    fused = _fused([960], 576)
    with torch.no_grad():
        fused.layers[0].weight[-1, -1] += 1  # the packed copy no longer matches its weight
    assert rowmatmul.Plan.build(fused) is None


def test_two_threads_split_the_outputs_and_keep_the_bits(kernel):
    """Half the outputs on torch's OpenMP team, and on the library's own helper thread
    (where a process has no OpenMP runtime): the bits of one thread either way."""
    fused = _fused([3072], 576)
    x = torch.randn(16, 576).to(torch.bfloat16)
    alone = rowmatmul.matmul(x, fused)
    lib = rowops.library()
    torch.set_num_threads(2)
    assert rowmatmul.threads() == 2
    try:
        for second in (0, 2):
            assert lib.second_thread(second) == (second or 1)
            for _ in range(3):  # the second thread woken from sleep and while it spins
                assert torch.equal(rowmatmul.matmul(x, fused), alone)
    finally:
        lib.second_thread(0)
    assert torch.equal(alone, _expected(x, fused))


def test_two_thread_calls_run_on_torchs_openmp_team(kernel):
    """A helper thread of our own beside torch's OpenMP worker shares the second core
    with it (measured slower, rowmatmul.h): where torch runs on OpenMP, so does the
    kernel's second half."""
    assert "OpenMP" in torch.__config__.parallel_info()  # the CPU wheel the suite installs
    assert rowops.library().second_thread(0) == 1


_FORKED_CHILD = """
import os, sys, torch
from tensorstream.engine.models import rowmatmul, rowops
from tensorstream.engine.models.packing import FusedLinear
torch.set_num_threads(2)
layer = torch.nn.Linear(576, 3072, bias=False, dtype=torch.bfloat16).requires_grad_(False)
fused = FusedLinear.build([layer])
x = torch.randn(16, 576).to(torch.bfloat16)
if sys.argv[1] == "kernel first":
    before = rowmatmul.matmul(x, fused)  # torch's OpenMP team ran it here
    assert rowops.library().second_thread(0) == 1
else:  # only torch's operators on two threads before the fork, the kernel not yet
    torch.randn(1 << 22).sum()
    torch.set_num_threads(1)
    before = rowmatmul.matmul(x, fused)
    torch.set_num_threads(2)
pid = os.fork()
if pid == 0:
    ok = rowops.library().second_thread(0) == 2  # the own helper: libgomp's team is gone
    after = rowmatmul.matmul(x, fused)
    # compared without a torch operator: those hang in a child after OpenMP ran
    same = bytes(after.view(torch.int16).numpy()) == bytes(before.view(torch.int16).numpy())
    os._exit(0 if ok and same else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("before_fork", ["kernel first", "torch first"])
def test_a_forked_child_runs_two_threads_on_its_own_helper(kernel, before_fork):
    """libgomp's team is not in a forked child, and waits for it forever: there the
    second half goes to the library's own helper thread, with the same bits, also where
    the parent had not run the kernel on two threads yet."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORKED_CHILD, before_fork], timeout=120,
                          check=False, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


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
    """Staggered bf16 requests on the real SmolLM2: every token and logprob the same in two
    runs with the kernel, and (on AMX, where its bits are oneDNN's) with oneDNN alone; the
    kernel really ran (decode steps and the head)."""
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
    assert runs[True][0] == runs[True][1]
    if _amx_kernel():
        assert runs[True][0] == runs[False][0]


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
