"""Small batches are padded so each row's linear-layer bits do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from tensorstream.engine.models import llama


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (576, 49152)])
@pytest.mark.parametrize("fast", [True, False], ids=["packed", "plain"])
def test_rows_get_the_bits_they_get_in_any_batch(threads, dtype, shape, fast, monkeypatch):
    monkeypatch.setattr(llama.packing, "FAST_LINEARS", fast)
    generator = torch.Generator().manual_seed(1)
    layer = llama.Linear(*shape, bias=False)
    layer.weight = torch.nn.Parameter(torch.randn(shape[1], shape[0], generator=generator))
    layer.to(dtype)
    x = torch.randn(24, shape[0], generator=generator).to(dtype)
    with torch.no_grad():
        full = llama._linear(x, layer, None, "probe")
        for rows in range(1, 24):
            assert torch.equal(llama._linear(x[:rows], layer, None, "probe"), full[:rows]), rows


def test_padding_only_where_the_cpu_needs_it(threads):
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (False, True):
            table = llama._probed_padding(dtype, threads, packed)
            assert all(m <= padded for m, padded in enumerate(table, start=1))
            assert all(llama.padded_rows(r, dtype, packed) >= r for r in range(1, 40))
    if llama.packing.packed_dtype(torch.float32):
        # oneDNN's packed float32 kernel: rows never depend on the batch.
        assert llama._probed_padding(torch.float32, threads, True) == ()
    if not llama.cpu_matmul_supported(torch.bfloat16):
        # Reference bf16 kernel: rows never depend on the batch, so nothing is padded.
        assert llama.padded_rows(1, torch.bfloat16) == 1
