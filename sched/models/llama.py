"""One decoder-only transformer for the Llama family (Llama 2/3, SmolLM2, Mistral),
Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before rotary), running
over the paged KV pool.

Parameters are named like Hugging Face's, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj`; `load_weights` takes Hugging Face
names and does the fusing.

Under tensor parallelism (a `TPGroup` of size > 1) each rank holds a Megatron-style
shard with this rank's shapes: q/k/v (by heads) and gate/up split by output rows,
o/down by input columns and summed over the ranks, embedding and LM head by vocab
rows. `load_weights` takes full Hugging Face tensors and keeps this rank's part;
`forward` gives every rank the same full logits. A group of size 1 changes nothing.

This module computes; it never reads files, never allocates KV slots, never starts
processes and never imports transformers' modelling code."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels.fp8_linear import FP8
from sgl.kernels.layers import RopeTables, add_rms_norm, apply_rope, rms_norm, rope_tables, silu_and_mul
from sgl.kernels.lora import LoraBatch
from sgl.kernels.norm_rope_store import available as fused_available
from sgl.kernels.norm_rope_store import norm_rope_store
from sgl.sched.models.forward_batch import ForwardBatch
from sgl.sched.models.lora_layers import LoraSpec
from sgl.sched.models.parallel import TPGroup
from sgl.sched.models.tp_layers import Embedding, Linear, local_heads, rank_slice

if TYPE_CHECKING:
    from sgl.sched.models.model_config import AnyConfig

_SUPPORTED_ROPE = ("default", "llama3", "linear")


def rope_settings(config: AnyConfig) -> tuple[float, dict | None]:
    """(theta, scaling dict or None), from transformers 5's `rope_parameters` or
    the older `rope_theta` / `rope_scaling` attributes."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    scaling = getattr(config, "rope_scaling", None) or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in _SUPPORTED_ROPE:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(_SUPPORTED_ROPE)})")
    return theta, (dict(scaling) if rope_type != "default" else None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self,
        config: AnyConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
        lora: LoraSpec | None,
    ):
        super().__init__()
        hidden = config.hidden_size
        self.layer_id = layer_id
        total_heads = config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        # This rank's heads; q_start / kv_start are the first one's index in the full model.
        self.num_heads, self.num_kv_heads = local_heads(total_heads, self.total_kv_heads, tp)
        self.q_start = tp.rank * self.num_heads
        self.kv_start = tp.rank * self.total_kv_heads // tp.size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv = (self.q_size, self.kv_size, self.kv_size)
        slots = LoraSpec.none() if lora is None else lora
        self.qkv_proj = Linear(hidden, sum(qkv), qkv_bias, dtype, device,
                               lora=slots.weights(("q_proj", "k_proj", "v_proj"), hidden, qkv, dtype, device))
        self.o_proj = Linear(self.q_size, hidden, o_bias, dtype, device, reduce=tp,
                             lora=slots.weights(("o_proj",), self.q_size, (hidden,), dtype, device))
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None
        self.fused: bool | None = None  # the fused kernel's, decided at the first forward (it needs the pool)

    def project(self, x: torch.Tensor, fb: ForwardBatch, rope: RopeTables) -> tuple[torch.Tensor, ...]:
        """q, k, v of the rows of x ([T, heads, head_dim] each), with their K/V written to the pool."""
        t = x.shape[0]
        qkv = self.qkv_proj(x, fb.lora)
        pool = fb.kv_pool
        if self.fused is None:
            self.fused = fused_available(x.device, x.dtype, pool.dtype)
        if self.fused:
            # Norms, rotary and the KV write in one launch (sgl.kernels.norm_rope_store), eager
            # and under CUDA graphs alike, so the two give the same numbers.
            qn, kn = self.q_norm, self.k_norm
            return norm_rope_store(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, qn.weight if qn else None,
                kn.weight if kn else None, qn.eps if qn else 0.0, fb.positions, rope.cos_sin,
                pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], fb.out_cache_loc)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, fb.positions, rope)
        pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The attention of the rows' queries ([T, q_size]), by the batch's planned backend."""
        pool = fb.kv_pool
        o = fb.attn_backend.forward(q, k, v, pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], self.scale)
        return o.reshape(q.shape[0], self.q_size)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: RopeTables) -> torch.Tensor:
        q, k, v = self.project(x, fb, rope)
        return self.o_proj(self.attend(q, k, v, fb), fb.lora)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype, device: torch.device, tp: TPGroup,
                 lora: LoraSpec | None):
        super().__init__()
        lo, hi = tp.split(inter)
        n = hi - lo
        slots = LoraSpec.none() if lora is None else lora
        self.gate_up_proj = Linear(hidden, 2 * n, bias, dtype, device,
                                   lora=slots.weights(("gate_proj", "up_proj"), hidden, (n, n), dtype, device))
        self.down_proj = Linear(n, hidden, bias, dtype, device, reduce=tp,
                                lora=slots.weights(("down_proj",), n, (hidden,), dtype, device))

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, lora)), lora)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: AnyConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
        lora: LoraSpec | None,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_id, qkv_bias, o_bias, qk_norm, dtype, device, tp, lora)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = MLP(config.hidden_size, config.intermediate_size, mlp_bias, dtype, device, tp, lora)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def before_attention(
        self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: (q, k, v, residual), the K/V written to the pool."""
        ln = self.input_layernorm
        if residual is None:
            residual, x = h, ln(h)
        else:
            x, residual = add_rms_norm(h, residual, ln.weight, ln.eps)
        q, k, v = self.self_attn.project(x, fb, rope)
        return q, k, v, residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor,
                        fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's output o ([T, q_size]) on: (h, residual)."""
        h = self.self_attn.o_proj(o, fb.lora)
        ln = self.post_attention_layernorm
        x, residual = add_rms_norm(h, residual, ln.weight, ln.eps)
        return self.mlp(x, fb.lora), residual

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(h, residual, fb, rope)
        return self.after_attention(self.self_attn.attend(q, k, v, fb), residual, fb)


class Backbone(nn.Module):
    def __init__(
        self,
        config: AnyConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
        lora: LoraSpec | None,
    ):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, qk_norm, dtype, device, tp, lora)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM2 / Mistral. Subclasses only change the three flags below."""

    qkv_bias_default = False  # Qwen2 always has q/k/v bias; the others follow config.attention_bias
    qk_norm = False
    o_bias_follows_config = True

    def __init__(
        self,
        config: AnyConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TPGroup = TPGroup(),
        lora: LoraSpec | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.tp = tp
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError("sliding-window attention layers are not supported by sgl's attention backends")
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias_default or attn_bias
        o_bias = attn_bias and self.o_bias_follows_config
        self.model = Backbone(config, qkv_bias, o_bias, self.qk_norm, dtype, device, tp, lora)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        local_vocab = self.model.embed_tokens.weight.shape[0]  # this rank's rows, as the embedding's
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(config.hidden_size, local_vocab, False, dtype, device)
        )

        attn = cast(DecoderLayer, self.model.layers[0]).self_attn
        self.num_layers: int = config.num_hidden_layers
        # This rank's heads: the KV pool and the attention backends are sized from them.
        self.num_heads: int = attn.num_heads
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        self.vocab_size: int = config.vocab_size  # the full vocab, as the logits are
        self.dtype = dtype
        self.quantization: str | None = None  # of the projections' weights (quantize_fp8: "fp8")
        # Mistral v0.1 attends within a window; up to the window that equals full attention.
        window = getattr(config, "sliding_window", None) if not layer_types else None
        self.context_len: int = min(config.max_position_embeddings, window or config.max_position_embeddings)
        theta, scaling = rope_settings(config)
        # This model's own tables: two engines in one process never share them.
        self.rope = rope_tables(self.head_dim, config.max_position_embeddings, theta, scaling, device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] in the model's dtype for the rows `fb.logits_indices` of the
        packed batch (the sampler takes float32 where it needs it; greedy argmax does not);
        with `fb.pool`, its rows' final-norm hidden states pooled into `fb.pool.out`."""
        h = self.embed(fb.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, fb, self.rope)
        assert residual is not None
        if fb.pool is not None:
            fb.pool.pool(self.final_norm(h[fb.pool.rows], residual[fb.pool.rows]))
        # Norm and LM head only on the rows that predict a token: prefill computes the others for the KV alone.
        return self.lm_logits(self.final_norm(h[fb.logits_indices], residual[fb.logits_indices]))

    # ---- the forward in pieces, for CUDA graphs of everything but attention ----

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output added to the residual stream and normalised, row by row."""
        return self.model.norm(h + residual)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits [R, vocab] of final-norm hidden states [R, hidden]."""
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, head)
        if self.tp.size > 1:  # each rank's vocab slice, joined, then the padding rows dropped
            logits = self.tp.all_gather_last(logits)[:, : self.vocab_size].contiguous()
        return logits

    # ---- weights ----

    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _shard_range(self, fused: str, shard: int, layer: DecoderLayer) -> tuple[int, int]:
        if fused == "qkv_proj":
            a = layer.self_attn
            starts = (0, a.q_size, a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
            return starts[shard], starts[shard + 1]
        inter = layer.mlp.gate_up_proj.weight.shape[0] // 2  # this rank's part of intermediate_size
        return shard * inter, (shard + 1) * inter

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors in (full tensors: under tensor parallelism
        this rank keeps its part); returns the names of our parameters (with `#shard`
        suffixes for fused parts) that were filled. Raises KeyError naming an
        unexpected tensor and ValueError on a shape mismatch."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}: no parameter {target!r} in {type(self).__name__}")
            param = params[target]
            if self.tp.size > 1:
                tensor = self._rank_part(name, target, shard, tensor)
            if shard is None:
                lo, hi = 0, param.shape[0]
            else:
                layer = cast(DecoderLayer, self.model.layers[int(parts[2])])
                lo, hi = self._shard_range(target.split(".")[-2], shard, layer)
            dst = param.data if shard is None else param.data[lo:hi]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            if param.dtype == FP8:  # an FP8 projection's weight: quantized as it lands
                cast(Linear, self.get_submodule(target.rpartition(".")[0])).load_rows(lo, hi, tensor)
            else:
                dst.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def projections(self) -> Iterator[Linear]:
        """The decoder layers' linear layers (not the LM head)."""
        for layer in self.decoder_layers:
            yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def quantize_fp8(self) -> None:
        """Hold every projection's weight in FP8 (sgl.kernels.fp8_linear), before its
        weights load: `load_weights` quantizes them as they arrive, and any later update
        the same way. Embeddings, norms and the LM head stay in the model's dtype."""
        for proj in self.projections():
            proj.to_fp8()
        self.quantization = "fp8"

    def weight_values(self, param: str) -> torch.Tensor:
        """Our parameter `param`'s values in the model's dtype (an FP8 weight dequantized)."""
        owner, _, leaf = param.rpartition(".")
        module = self.get_submodule(owner)
        if isinstance(module, Linear) and leaf == "weight":
            return module.weight_values()
        return cast(torch.Tensor, getattr(module, leaf)).data

    def _rank_part(self, name: str, target: str, shard: int | None, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full Hugging Face tensor `name` that fills `target`:
        q/k/v (by heads) and gate/up rows, o/down weight columns, embedding and LM head
        rows (zero-padded past the vocab); norms and o/down biases are replicated whole."""
        kind = target.split(".")[-2]
        if kind in ("embed_tokens", "lm_head"):
            emb = self.model.embed_tokens
            return rank_slice(name, full, 0, self.vocab_size, emb.lo, emb.hi)
        inter = self.config.intermediate_size
        if kind == "gate_up_proj":
            return rank_slice(name, full, 0, inter, *self.tp.split(inter))
        if kind == "down_proj" and target.endswith(".weight"):
            return rank_slice(name, full, 1, inter, *self.tp.split(inter))
        if kind not in ("qkv_proj", "o_proj") or target.endswith("o_proj.bias"):
            return full
        a = cast(DecoderLayer, self.model.layers[int(target.split(".")[2])]).self_attn
        d = a.head_dim
        q = (self.config.num_attention_heads * d, a.q_start * d, (a.q_start + a.num_heads) * d)
        kv = (a.total_kv_heads * d, a.kv_start * d, (a.kv_start + a.num_kv_heads) * d)
        if kind == "o_proj":
            return rank_slice(name, full, 1, *q)
        return rank_slice(name, full, 0, *(q if shard == 0 else kv))

    def load_lora(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill LoRA slot `slot` with an adapter's matrices ((layer, Hugging Face projection)
        -> (A [r, in], B [out, r] scaled), full: under tensor parallelism this rank keeps its
        part, as `load_weights` does); every projection it leaves out is zero. Queued on the
        device in order with the forwards (call it between them)."""
        for proj in self.projections():
            if proj.lora is not None:
                proj.lora.clear(slot)
        for (i, module), (a, b) in weights.items():
            layer = cast(DecoderLayer, self.model.layers[i])
            fused, part = self._FUSED.get(module, (module, 0))
            proj = getattr(layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp, fused)
            assert proj.lora is not None, f"no LoRA slots for {module}: the adapter was checked against the targets"
            if self.tp.size > 1:
                name = f"model.layers.{i}.{fused}.weight"
                hf = f"model.layers.{i}.{module}.lora"
                if proj.reduce is None:  # column-parallel: this rank's output rows of B
                    b = self._rank_part(hf, name, part if fused in ("qkv_proj", "gate_up_proj") else None, b)
                else:  # row-parallel: this rank's input columns of A, cut on the device (a strided
                    # view of the pinned adapter would copy synchronously, waiting for the queue)
                    a = self._rank_part(hf, name, None, a.to(proj.lora.a.device, non_blocking=True))
            proj.lora.load(slot, part, a, b)

    def unfuse(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The Hugging Face-named tensors that `load_weights` would fuse into our
        parameter `name` holding `tensor` (views of it): the inverse of the fusing."""
        parts = name.split(".")
        shards = [(hf, shard) for hf, (fused, shard) in self._FUSED.items() if len(parts) >= 2 and fused == parts[-2]]
        if not shards:
            yield name, tensor
            return
        layer = cast(DecoderLayer, self.model.layers[int(parts[2])])
        for hf, shard in shards:
            lo, hi = self._shard_range(parts[-2], shard, layer)
            yield ".".join(parts[:-2] + [hf, parts[-1]]), tensor[lo:hi]

    def expected_weights(self) -> dict[str, str]:
        """Our loaded-name (as `load_weights` returns them) -> the Hugging Face name that fills it."""
        inverse = {fused_shard: hf for hf, fused_shard in self._FUSED.items()}
        out: dict[str, str] = {}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            shards = sorted(shard for fused, shard in inverse if fused == parts[-2]) if len(parts) >= 2 else []
            if not shards:
                out[name] = name
            for shard in shards:
                out[f"{name}#{shard}"] = ".".join(parts[:-2] + [inverse[(parts[-2], shard)], parts[-1]])
        return out


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True
    o_bias_follows_config = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
