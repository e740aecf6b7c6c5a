"""Plain-torch Llama-family causal LM (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

Module and parameter names are the Hugging Face ones (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``...), so every checkpoint written for transformers' classes fills
this model unchanged. The forward pass mirrors transformers' op order (RMSNorm in
float32, cos/sin in float32 then cast, SDPA with grouped-query attention), which
keeps logits equal to the reference's; only the KV cache differs: it is the
engine's own (``engine/kvcache.py``), addressed through an :class:`AttentionBatch`.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorstream.engine.cpu_dtype import cpu_matmul_supported
from tensorstream.engine.models import packing, rowmatmul, rowops
from tensorstream.engine.models.config import NativeConfig
from tensorstream.engine.models.fastpath import LeanStack
from tensorstream.engine.models.kvattention import AttentionBatch, CacheAttention, fused_pass
from tensorstream.engine.models.packing import FusedLinear, PackQuota
from tensorstream.engine.models.rope import RotaryEmbedding, apply_rotary, rotate

__all__ = ["AttentionBatch", "NativeCausalLM"]


class Linear(nn.Linear):
    """``nn.Linear`` without random init: its weights always come from the checkpoint.

    Under no-grad and bf16 it runs through a prepacked oneDNN copy of its weight once one
    is built (:func:`packing.packed`), so forward hooks (tensor parallelism's all-reduce) still
    fire around the faster matmul.
    """

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and packing.packed_dtype(x.dtype):
            fast = packing.packed(self, "_fast", (self,), inside_forward=True)
            if fast is not None:
                return fast(x)
        layout = rowmatmul.current()
        if layout is not None and x.dtype == layout.dtype and not torch.is_grad_enabled():
            # in an engine pass: rows by role (rowmatmul.Layout); not packed yet (bf16), the
            # packed matmul's bits
            flat = x.reshape(-1, x.shape[-1])
            out = rowmatmul.segmented(flat, layout, self._pieces, self._plain)
            return out.view(*x.shape[:-1], out.shape[-1])
        return super().forward(x)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _pieces(self, x: torch.Tensor) -> torch.Tensor:
        out = rowmatmul.plain(x, self)  # the packed kernel's bits where it has its own
        return rowmatmul.pieces(x, self._plain, packed=False) if out is None else out


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random init.

    Its default init (``normal_``) on the meta device goes through torch's Python
    reference ops, whose first use imports ``torch._dynamo``: measured 1-9 s of a
    cold start, for values that are thrown away.
    """

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: an engine pass on the fused row operators (:func:`fused_pass`)."""
        if fused and x.dtype == self.weight.dtype:
            flat = x.reshape(-1, x.shape[-1])
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            return rowops.add_norm(flat, self.weight, self.variance_epsilon).view(x.shape)
        # torch's fused kernel: one op instead of six, same float32 arithmetic.
        normed = F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=self.variance_epsilon)
        return self.weight * normed.to(x.dtype)


#: Batches of fewer than ``PAD_BELOW`` rows run their linear layers as ``PADDED_ROWS``
#: rows, repeating the first. One row would take a GEMV path, whose bf16 sums round
#: differently from the GEMM that several rows take (measured: K=1536, 9 of 100 rows differ;
#: oneDNN's prepacked kernel at K >= 2048 too), and a request decoding alone must get the
#: same tokens as beside others; GEMM rows agree bit for bit whatever their number (checked
#: for 2-16 rows, K up to 5632). Four rows rather than two: oneDNN's prepacked bf16 kernel
#: streams the weights faster at four (same process, alternating steps: one row 1.13-1.14x,
#: two rows 1.08-1.10x per step; three rows padded to four lost, 0.96-0.97x). These figures
#: are oneDNN's bf16 kernels' (AVX-512/AMX CPUs); other matmuls are probed instead
#: (:func:`_probed_padding`).
PAD_BELOW = 3
PADDED_ROWS = 4


def padded_rows(rows: int, dtype: torch.dtype, packed: bool = False) -> int:
    """How many rows a batch of ``rows`` runs its linear layers as (``rows`` or more);
    ``packed``: through a :class:`~packing.FusedLinear` (oneDNN), else torch's ``linear``."""
    if dtype == torch.bfloat16 and cpu_matmul_supported(dtype):
        return PADDED_ROWS if 0 < rows < PAD_BELOW else rows
    table = _probed_padding(dtype, torch.get_num_threads(), packed)
    return table[rows - 1] if 0 < rows <= len(table) else rows


#: Row counts the probe checks; larger batches run as they are.
_PROBE_ROWS = 32
#: (in, out) features the probe multiplies: a row count must agree for every one. Two,
#: because the kernels' blocking depends on the reduction length: on a 2-core AVX-512
#: Xeon, MKL float32 on two threads agrees from 4 rows at 640 inputs but only from 16 at
#: 1536, and oneDNN's packed float32 differs at one row at 1536 only.
_PROBE_SHAPES = ((640, 384), (1536, 576))


@functools.cache
def _probed_padding(dtype: torch.dtype, threads: int, packed: bool) -> tuple[int, ...]:
    """For 1, 2, ... rows: the fewest rows at or above it whose plain ``dtype`` matmul gives
    each row the bits it gets among :data:`_PROBE_ROWS`. Probed, because it is the CPU's and
    the thread count's: on a 2-core AVX2 AMD EPYC, float32 (MKL) on one thread agrees from
    4 rows on, on two threads at 4, 8 and from 12 on; bfloat16 without oneDNN (torch's
    reference kernel) and float32 through oneDNN's packed kernel (``packed``) at every
    count, where padding would only cost (4x at one row).
    Counts from which every larger one agrees are left out of the table (not padded); a
    count with no agreeing one above it in the probe runs unpadded too.
    """
    generator = torch.Generator().manual_seed(0)
    agree = [True] * _PROBE_ROWS
    for features, outputs in _PROBE_SHAPES:
        weight = torch.randn(outputs, features, generator=generator).to(dtype)
        x = torch.randn(_PROBE_ROWS, features, generator=generator).to(dtype)
        matmul = functools.partial(F.linear, weight=weight)
        if packed:
            layer = nn.Linear(features, outputs, bias=False, dtype=dtype)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            fused = FusedLinear.build([layer])
            matmul = fused if fused is not None else matmul
        full = matmul(x)
        for m in range(1, _PROBE_ROWS + 1):
            agree[m - 1] = agree[m - 1] and torch.equal(matmul(x[:m]), full[:m])
    settled = _PROBE_ROWS
    while settled > 1 and agree[settled - 2]:
        settled -= 1  # every count from `settled` on agrees
    table = []
    for m in range(1, settled):
        table.append(next((k for k in range(m, settled + 1) if agree[k - 1]), m))
    return tuple(table)


def _pad_rows(x: torch.Tensor, rows: int, padded: int) -> torch.Tensor:
    """``x`` as [padded, features]: its ``rows`` rows, then copies of the first."""
    flat = x.reshape(rows, x.shape[-1])
    return torch.cat([flat, flat[:1].expand(padded - rows, -1)])


def _linear(x: torch.Tensor, layer: nn.Linear, lora: Any, name: str) -> torch.Tensor:
    """``layer`` (+ its LoRA update) applied to ``x``, small batches padded (:func:`padded_rows`)."""
    rows = x.shape[:-1].numel()
    packed = isinstance(layer.__dict__.get("_fast"), FusedLinear)
    padded = padded_rows(rows, x.dtype, packed)
    if padded == rows:
        return _linear_rows(x, layer, lora, name)
    out = _linear_rows(_pad_rows(x, rows, padded), layer, lora, name)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear_rows(x: torch.Tensor, layer: nn.Linear, lora: Any, name: str) -> torch.Tensor:
    out = layer(x)
    if lora is not None:
        out = lora.apply(name, x, out)
    return out


def _fused_linear(
    x: torch.Tensor, fused: FusedLinear, lora: Any, names: tuple[str, ...], split: bool = True
) -> list[torch.Tensor]:
    """``fused``'s layers applied to ``x`` in one matmul, split back per layer (+ LoRA);
    ``split=False`` (no LoRA) returns the one joint output. Small batches padded (PAD_BELOW)."""
    rows = x.shape[:-1].numel()
    padded = padded_rows(rows, x.dtype, packed=True)
    if padded == rows:
        return _fused_rows(x, fused, lora, names, split)
    outs = _fused_rows(_pad_rows(x, rows, padded), fused, lora, names, split)
    return [out[:rows].reshape(*x.shape[:-1], out.shape[-1]) for out in outs]


def _fused_rows(
    x: torch.Tensor, fused: FusedLinear, lora: Any, names: tuple[str, ...], split: bool
) -> list[torch.Tensor]:
    if not split:
        return [fused(x)]
    outs = list(fused(x).split(fused.sizes, dim=-1))
    if lora is not None:
        outs = [lora.apply(name, x, out) for name, out in zip(names, outs, strict=True)]
    return outs


def _fusion(
    owner: nn.Module, slot: str, layers: tuple[nn.Linear, ...], x: torch.Tensor
) -> FusedLinear | None:
    """The packed joint matmul of ``layers`` for input ``x``, or None (plain path)."""
    if x.dtype != layers[0].weight.dtype or not packing.packed_dtype(x.dtype):
        return None
    return packing.packed(owner, slot, layers)


def _row_layout(
    input_ids: torch.Tensor, batch: AttentionBatch | None, dtype: torch.dtype
) -> rowmatmul.Layout | None:
    """An engine pass's :class:`rowmatmul.Layout` (token rows ``[tokens, 1]``), or None
    (``rowmatmul.engine_pass`` drops it where nothing needs splitting). CPU passes only:
    the split is about the CPU's matmuls."""
    if batch is None or batch.plan is None or input_ids.device.type != "cpu":
        return None
    if input_ids.dim() != 2 or input_ids.shape[1] != 1:
        return None
    big = tuple(
        (item[1], item[2])
        for item in batch.plan
        if item[0] == "prefill" and item[2] - item[1] > rowmatmul.MAX_ROWS
    )
    return rowmatmul.Layout(input_ids.shape[0], big, dtype)


class Attention(CacheAttention, nn.Module):
    """Grouped-query self-attention over the engine's KV cache."""

    def __init__(self, config: NativeConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.groups = self.heads // self.kv_heads
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = Linear(config.hidden_size, self.heads * d, bias=qkv_bias)
        self.k_proj = Linear(config.hidden_size, self.kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(config.hidden_size, self.kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(self.heads * d, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.window = config.sliding_window
        self.fusable = rowops.check_shapes(d, self.heads, self.kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch | None,
    ) -> torch.Tensor:
        rows, tokens, _ = x.shape
        lora = batch.adapters if batch is not None else None
        prefix = f"model.layers.{self.layer}.self_attn."
        names = (prefix + "q_proj", prefix + "k_proj", prefix + "v_proj")
        fused = _fusion(self, "_qkv", (self.q_proj, self.k_proj, self.v_proj), x)
        if self.fused_rows(x, batch):
            # The fused row operators: rotation, cache write and decode attention in C.
            projections = (self.q_proj, self.k_proj, self.v_proj)
            if fused is not None:
                qkv = _fused_linear(x, fused, lora, names, split=lora is not None)
            else:
                qkv = [_linear(x, p, lora, n) for p, n in zip(projections, names, strict=True)]
            flat = [t.reshape(rows * tokens, t.shape[-1]) for t in qkv]
            q, k, v = self.split_qkv(flat[0]) if len(flat) == 1 else flat
            d = self.head_dim
            out = self.attend_rows(q, k, v, cos.view(-1, d), sin.view(-1, d), batch)
            return _linear(out.view(rows, tokens, -1), self.o_proj, lora, prefix + "o_proj")
        if fused is not None and lora is None and not self.qk_norm:
            # Queries and keys are adjacent in the fused output: rotate them in one pass.
            (qkv,) = _fused_linear(x, fused, None, names, split=False)
            heads = self.heads + self.kv_heads
            qk = qkv[..., : heads * self.head_dim].view(rows, tokens, heads, self.head_dim)
            qk = rotate(qk.transpose(1, 2), cos, sin)
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            v = qkv[..., heads * self.head_dim :].view(rows, tokens, -1, self.head_dim)
            v = v.transpose(1, 2)
        else:
            if fused is not None:
                q, k, v = _fused_linear(x, fused, lora, names)
            else:
                q = _linear(x, self.q_proj, lora, names[0])
                k = _linear(x, self.k_proj, lora, names[1])
                v = _linear(x, self.v_proj, lora, names[2])
            q = q.view(rows, tokens, -1, self.head_dim)
            k = k.view(rows, tokens, -1, self.head_dim)
            v = v.view(rows, tokens, -1, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary(q, k, cos, sin)
        if batch is not None and batch.plan is not None:
            out = self._attend_planned(q, k, v, batch)
        else:
            mask = batch.mask if batch is not None else None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and tokens > 1,
                enable_gqa=self.groups > 1,
            )  # fmt: skip
        out = out.transpose(1, 2).reshape(rows, tokens, -1)
        return _linear(out, self.o_proj, lora, prefix + "o_proj")


class MLP(nn.Module):
    """SiLU-gated feed-forward block."""

    def __init__(self, config: NativeConfig, layer: int) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.prefix = f"model.layers.{layer}.mlp."
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, lora: Any = None, fused: bool = False) -> torch.Tensor:
        """``fused``: an engine pass on the fused row operators (:func:`fused_pass`)."""
        p = self.prefix
        joint = _fusion(self, "_gate_up", (self.gate_proj, self.up_proj), x)
        if joint is not None:
            gate, up = _fused_linear(x, joint, lora, (p + "gate_proj", p + "up_proj"))
        else:
            gate = _linear(x, self.gate_proj, lora, p + "gate_proj")
            up = _linear(x, self.up_proj, lora, p + "up_proj")
        if fused:
            n = gate.shape[-1]
            gated = rowops.silu_mul(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape)
        else:
            gated = F.silu(gate) * up
        return _linear(gated, self.down_proj, lora, p + "down_proj")


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, config: NativeConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch | None
    ) -> torch.Tensor:
        fused = fused_pass(x, batch)
        x = x + self.self_attn(self.input_layernorm(x, fused=fused), cos, sin, batch)
        lora = batch.adapters if batch is not None else None
        return x + self.mlp(self.post_attention_layernorm(x, fused=fused), lora, fused=fused)


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.rope, config.head_dim, config.max_position_embeddings
        )


class NativeCausalLM(nn.Module):
    """The Llama-family causal LM.

    Args:
        config: the parsed config.json.

    Build it under ``torch.device("meta")`` and fill it with
    :func:`tensorstream.engine.models.build_native`; calling it like a transformers
    model (``model(input_ids).logits``) runs a plain causal forward without cache.
    """

    base_model_prefix = "model"
    lora_manager: Any = None  # set by NativeLoRAManager; model(...) then honours activate()

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        rowops.start_build()  # compiles (or finds) the fused operators while weights load
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch | None
    ) -> torch.Tensor:
        """Final-norm hidden states [batch, tokens, hidden] for ``input_ids`` at ``positions``."""
        self._set_pack_budget()
        with rowmatmul.engine_pass(_row_layout(input_ids, batch, self.dtype)):
            return self._hidden_states(input_ids, positions, batch)

    def _hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch | None
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        lean = self.__dict__.get("_lean")
        if lean is not None and lean.applies(x, batch):
            x = lean.run(x, cos, sin, batch)
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, batch)
            if batch is not None and batch.plan is not None and (lean is None or not lean.fresh()):
                # after the module pass, which packs: the lean one needs every layer packed
                self.__dict__["_lean"] = LeanStack.build(self)
        return self.model.norm(x, fused=fused_pass(x, batch))

    def _set_pack_budget(self) -> None:
        """Tell the layers the model's linear-weight bytes (``pack_enabled``'s budget) and
        share one :class:`PackQuota` with them (once); refill it for this forward pass."""
        quota = self.__dict__.get("_quota")
        if quota is None:
            quota = self.__dict__["_quota"] = PackQuota()
            linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
            total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
            for module in self.modules():
                if isinstance(module, (nn.Linear, Attention, MLP)):
                    module.__dict__["_budget"] = total
                    module.__dict__["_quota"] = quota
        quota.left = packing.PACK_STEP_BYTES

    def logits(self, hidden: torch.Tensor, adapters: Any = None) -> torch.Tensor:
        """LM-head logits of ``hidden`` (contiguous, so CPU bf16 matmul takes its fast path)."""
        # through _linear: a lone row is padded like every other layer's (PAD_BELOW)
        return _linear(hidden.contiguous(), self.lm_head, adapters, "lm_head")

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        """Causal forward over whole sequences (no cache); returns ``.logits`` like transformers."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        tokens = input_ids.shape[1]
        steps = torch.arange(tokens, device=input_ids.device)
        positions = steps[None].expand_as(input_ids)
        mask = None
        window = self.config.sliding_window
        if window is not None and tokens > window:  # causal within the window
            mask = (steps[None, :] <= steps[:, None]) & (steps[None, :] > steps[:, None] - window)
            mask = mask[None, None]
        adapters = self.lora_manager.active() if self.lora_manager is not None else None
        batch = AttentionBatch(mask=mask, adapters=adapters)
        hidden = self.hidden_states(input_ids, positions, batch)
        return SimpleNamespace(logits=self.logits(hidden, adapters))
