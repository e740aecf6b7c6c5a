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
def test_rows_get_the_bits_they_get_in_any_batch(threads, dtype, shape):
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
        table = llama._probed_padding(dtype, threads)
        assert all(m <= padded for m, padded in enumerate(table, start=1))
        # Whatever the table says is what the matmul does: a count it leaves alone agrees.
        assert [llama.padded_rows(r, dtype) >= r for r in range(1, 40)] == [True] * 39
    if not llama.cpu_matmul_supported(torch.bfloat16):
        # Reference bf16 kernel: rows never depend on the batch, so nothing is padded.
        assert llama.padded_rows(1, torch.bfloat16) == 1
