"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet linear attention interleaved with gated
full attention, and a sparse MoE with a shared expert; the Llama implementation for the rest.

What it takes from the Llama family as ModelConfig flags: q/k RMSNorm per head, RMSNorm applied as
(1 + w) (``norm_unit_offset``), rotary on the first quarter of each head
(``partial_rotary_factor``), and q_proj yielding a gate beside each head's query, the attention
output times its sigmoid (``attention_output_gate``). What is its own, here:

- ``GatedDeltaNet``, the ``linear_attention`` layers of ``layer_types``: in_proj_qkvz / in_proj_ba
  project q, k, v, the output gate z and the per-head b (the write strength beta = sigmoid(b))
  and a (the decay g = -exp(A_log) * softplus(a + dt_bias)); a causal depthwise convolution
  (SiLU) over q, k and v; the gated delta rule over L2-normalised q and k; an RMSNorm of the
  output gated by silu(z); out_proj. Its state per request (the convolution's last inputs and
  the recurrent matrix of each value head) lives in the request's state slot
  (engine_core/block_manager.py), whose tensors the runner binds here (``bind_state``).
- ``SharedExpertMoE``: the routed experts of models/moe.py plus a dense SwiGLU expert scaled by
  sigmoid(shared_expert_gate(x)).

The delta rule runs as torch code (models/delta_rule.py): chunked for a prompt chunk, one
recurrent step for decodes, the state carried from chunk to chunk through the slot. On CUDA the
decodes' step is our Triton kernel, in place on the slots (models/delta_rule_triton.py: what the
decode graphs replay), and prompt chunks take flash-linear-attention's kernels where it is
installed (``fla_kernels``). The math
follows HF transformers' torch fallback (modeling_qwen3_next.py), the reference the tests hold it
to. docs/design/kv-layer-groups.md says how the slots are owned; qwen3-next.md how a prefix hit
resumes at a saved state.

Qwen3.5's text model (dense or MoE; the CausalLM or the ConditionalGeneration layout) is this
network; what differs is read from its config: four linear-attention input projections in head
order (``separate_projections``), the ConditionalGeneration's ``model.language_model.`` names
and ``text_config``; its vision tower is models/qwen3_5_vl.py's (docs/design/qwen3-next.md,
"Qwen3.5").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import LinearAttentionConfig, ModelConfig
from engine_core.forward_context import StateRows, get_forward_context
from engine_core.models.delta_rule import (
    FlaKernels,
    chunk_gated_delta_rule,
    fla_kernels,
    recurrent_gated_delta_step,
)
from engine_core.models.layers import (
    Linear,
    MergedLinear,
    TPSharded,
    check_divisible,
    column_parallel_linear,
    rank_rows,
    row_parallel_linear,
)
from engine_core.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    first_norm,
    make_mlp,
    make_norm,
)
from engine_core.models.moe import SparseMoE, qwen3_dense_layers, refuse_unsupported
from engine_core.parallel import SINGLE, TPGroup

LAYER_KINDS = ("linear_attention", "full_attention")
# Qwen3.5's linear-attention input projections -> (the merged one that holds them, shard).
SEPARATE_PROJECTIONS = {
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}
# Qwen3.5's text and vision-language checkpoints, dense and MoE: the same layers as Qwen3-Next
# but for the layout of the linear-attention projections (LinearAttentionConfig).
QWEN3_5_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
VISION_TOWER_PREFIX = "model.visual."  # a Qwen3.5 ConditionalGeneration checkpoint's tower

logger = logging.getLogger(__name__)


class GatedDeltaNet(nn.Module, TPSharded):
    """One linear-attention layer; parameter names follow HF's ``linear_attn``.

    Under tensor parallelism each rank keeps whole key-head groups (a key head and the value
    heads it serves): their rows of in_proj_qkvz and in_proj_ba (grouped by key head in the
    checkpoint), their q, k and v channels of the convolution, their A_log and dt_bias, their
    columns of out_proj (summed over the ranks); the gated norm (one per head dim) whole.
    ``self.la`` is this rank's share, so the forward and the state slots are the local heads'."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.la = la = local_heads(config, tp)
        self.tp = tp
        self.key_dim = la.num_key_heads * la.key_head_dim
        self.value_dim = la.num_value_heads * la.value_head_dim
        hidden = config.hidden_size
        self.in_proj_qkvz, self.in_proj_ba = input_projections(hidden, la, tp)
        conv_dim = la.conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, la.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, config.norm_eps)
        self.out_proj = row_parallel_linear(self.value_dim * tp.size, hidden, False, tp)
        # The state slots' tensors, bound by the runner: [slots, conv_dim, kernel - 1] and
        # [slots, value_heads, key_head_dim, value_head_dim].
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        """A_log and dt_bias [Hv]: this rank's value heads (the norm has no TP split)."""
        return rank_rows(tensor, self.tp)

    def state_shapes(self, num_slots: int) -> list[tuple[int, ...]]:
        la = self.la
        return [
            (num_slots, la.conv_dim, la.conv_kernel - 1),
            (num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim),
        ]

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; each sequence of the step continues from its
        slot's state (from zero where its chunk starts the sequence) and leaves it there."""
        context = get_forward_context()
        rows, starts = context.state, context.attn_metadata.query_start_loc_cpu
        if rows is None:
            raise RuntimeError("a linear-attention layer ran without the step's state rows")
        assert self.conv_state is not None and self.recurrent_state is not None
        rows.zero_fresh(self.conv_state, self.recurrent_state)
        qkv, z, b, a = self.project(hidden)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] float32
        mixed = self.convolve(qkv, rows, starts)
        core = self.delta_rule(mixed, g, beta, rows, starts)
        return self.out_proj(self.norm(core, z).flatten(1))

    def delta_rule(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        starts: list[int],
    ) -> torch.Tensor:
        """The gated delta rule over the step, each sequence from its slot's state and back:
        mixed [T, C] -> [T, Hv, Dv]. On CUDA the decodes update their slots in place in one
        launch (models/delta_rule_triton.py: what decode graphs replay) and the longer chunks
        run in flash-linear-attention's kernels where it is installed; else in torch."""
        la, state = self.la, self.recurrent_state
        assert state is not None
        core = mixed.new_empty(mixed.shape[0], la.num_value_heads, la.value_head_dim)
        if rows.decode_rows is not None and rows.decode_slots is not None:
            if mixed.is_cuda:
                from engine_core.models.delta_rule_triton import decode_step_in_place  # triton

                decode_step_in_place(
                    mixed, rows.decode_rows, rows.decode_slots, g, beta, state, core,
                    la.num_key_heads,
                )  # fmt: skip
            else:
                self.decode_torch(mixed, g, beta, rows, core)
        if rows.verify:
            self.verify_steps(mixed, g, beta, rows, core)
        if rows.chunk_slots:
            kernels = fla_kernels() if mixed.is_cuda else None
            if kernels is not None:
                self.chunks_fla(kernels, mixed, g, beta, rows, core)
            else:
                self.chunks_torch(mixed, g, beta, rows, starts, core)
        return core

    def project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (q, k, v side by side [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]).
        Qwen3-Next's projections group their rows by key head: for each, its q, k, then the v
        and z of the value heads it serves (and its b's, then its a's); Qwen3.5's hold q, k, v
        (then z, and b then a) each whole, in head order."""
        la, num_tokens = self.la, hidden.shape[0]
        if la.separate_projections:
            qkv, z = self.in_proj_qkvz(hidden).split([la.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)
            z = z.reshape(num_tokens, la.num_value_heads, la.value_head_dim)
            return qkv, z, b, a
        per_key = la.num_value_heads // la.num_key_heads
        dk, vdims = la.key_head_dim, per_key * la.value_head_dim
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, la.num_key_heads, -1)
        q, k, v, z = qkvz.split([dk, dk, vdims, vdims], dim=-1)
        ba = self.in_proj_ba(hidden).view(num_tokens, la.num_key_heads, 2 * per_key)
        b, a = ba.split([per_key, per_key], dim=-1)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        z = z.reshape(num_tokens, la.num_value_heads, la.value_head_dim)
        return qkv, z, b.flatten(1), a.flatten(1)

    def convolve(self, qkv: torch.Tensor, rows: StateRows, starts: list[int]) -> torch.Tensor:
        """The causal depthwise convolution (then SiLU) of each sequence's chunk [T, C] after
        the last kernel - 1 inputs kept in its slot, which move on to the chunk's last ones."""
        assert self.conv_state is not None
        weight = self.conv1d.weight  # [C, 1, K]
        mixed = torch.empty_like(qkv)
        if rows.decode_rows is not None and rows.decode_slots is not None:
            slots = rows.decode_slots
            self.convolve_one(qkv, mixed, rows.decode_rows, slots, slots)
        for position in rows.verify:  # a state after every position, in its own row
            one, read, write = position.token_rows, position.read_rows, position.write_rows
            self.convolve_one(qkv, mixed, one, read, write)
        kernel = self.la.conv_kernel
        for seq, slot in rows.chunk_slots:
            lo, hi = starts[seq], starts[seq + 1]
            window = torch.cat([self.conv_state[slot], qkv[lo:hi].T], dim=-1)  # [C, K - 1 + L]
            self.conv_state[slot] = window[:, -(kernel - 1) :]
            out = F.conv1d(window.unsqueeze(0), weight, groups=weight.shape[0])[0]  # [C, L]
            mixed[lo:hi] = F.silu(out.T)
        return mixed

    def convolve_one(
        self,
        qkv: torch.Tensor,
        mixed: torch.Tensor,
        one: torch.Tensor,
        read: torch.Tensor,
        write: torch.Tensor,
    ) -> None:
        """The convolution of one token of each of N sequences (token rows ``one``) after the
        inputs in state rows ``read``, which move on into ``write`` [N, C, K - 1]."""
        assert self.conv_state is not None
        weight = self.conv1d.weight  # [C, 1, K]
        window = torch.cat([self.conv_state[read], qkv[one].unsqueeze(-1)], dim=-1)
        self.conv_state[write] = window[..., 1:]
        mixed[one] = F.silu((window * weight.squeeze(1)).sum(-1))

    def decode_torch(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        core: torch.Tensor,
    ) -> None:
        """The decodes' gated delta rule in torch (models/delta_rule.py), one recurrent step
        for all: mixed [T, C] -> their rows of core [T, Hv, Dv]."""
        assert rows.decode_rows is not None and rows.decode_slots is not None
        slots = rows.decode_slots
        self.recurrent_step(mixed, g, beta, rows.decode_rows, slots, slots, core)

    def verify_steps(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        core: torch.Tensor,
    ) -> None:
        """The verify sequences' gated delta rule in torch, one recurrent step per position for
        all of them, each position's state written to its own row (forward_context.py
        VerifyPosition). A handful of steps a layer, eagerly on every device (these steps have
        no graphs)."""
        for position in rows.verify:
            one, read, write = position.token_rows, position.read_rows, position.write_rows
            self.recurrent_step(mixed, g, beta, one, read, write, core)

    def recurrent_step(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        one: torch.Tensor,
        read: torch.Tensor,
        write: torch.Tensor,
        core: torch.Tensor,
    ) -> None:
        """One token of each of N sequences (token rows ``one``), from the state rows ``read``
        to ``write``: mixed [T, C] -> those rows of core [T, Hv, Dv]."""
        state = self.recurrent_state
        assert state is not None
        q, k, v = self.heads(mixed[one])
        out, after = recurrent_gated_delta_step(
            q, k, v, g[one], beta[one].float(), state[read].float()
        )
        state[write] = after.to(state.dtype)
        core[one] = out.to(core.dtype)

    def chunks_torch(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        starts: list[int],
        core: torch.Tensor,
    ) -> None:
        """The longer chunks' gated delta rule in torch, each in the chunked form (one
        sequence at a time): mixed [T, C] -> their rows of core [T, Hv, Dv]."""
        state = self.recurrent_state
        assert state is not None
        for seq, slot in rows.chunk_slots:
            lo, hi = starts[seq], starts[seq + 1]
            q, k, v = (x.transpose(0, 1) for x in self.heads(mixed[lo:hi]))  # [Hv, L, D]
            out, after = chunk_gated_delta_rule(
                q, k, v, g[lo:hi].T, beta[lo:hi].float().T, state[slot].float()
            )
            state[slot] = after.to(state.dtype)
            core[lo:hi] = out.transpose(0, 1).to(core.dtype)

    def chunks_fla(
        self,
        kernels: FlaKernels,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        core: torch.Tensor,
    ) -> None:
        """The longer chunks' gated delta rule in flash-linear-attention's Triton kernels
        (CUDA), all in one variable-length chunked launch; it L2-normalises q and k and serves
        several value heads per key head itself. mixed [T, C] -> their rows of core."""
        state = self.recurrent_state
        assert state is not None
        la, num = self.la, mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.view(num, la.num_key_heads, -1), k.view(num, la.num_key_heads, -1)
        v = v.view(num, la.num_value_heads, -1)
        if rows.chunk_rows is not None and rows.chunk_slot_ids is not None:
            many, slots = rows.chunk_rows, rows.chunk_slot_ids  # one batch of varied lengths
            out, after = kernels.chunk(
                q[None, many], k[None, many], v[None, many], g=g[None, many],
                beta=beta[None, many], initial_state=state[slots], output_final_state=True,
                cu_seqlens=rows.chunk_cu_seqlens, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            state[slots] = after.to(state.dtype)
            core[many] = out[0]

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [N, C] -> q, k, v [N, Hv, D] in float32: q and k
        L2-normalised, q scaled by Dk^-0.5, each key head repeated for the value heads it
        serves."""
        la, num = self.la, mixed.shape[0]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per_key = la.num_value_heads // la.num_key_heads
        q = l2norm(q.view(num, la.num_key_heads, -1)).repeat_interleave(per_key, dim=1)
        k = l2norm(k.view(num, la.num_key_heads, -1)).repeat_interleave(per_key, dim=1)
        return q * la.key_head_dim**-0.5, k, v.view(num, la.num_value_heads, -1)


def input_projections(
    hidden: int, la: LinearAttentionConfig, tp: TPGroup = SINGLE
) -> tuple[Linear, Linear]:
    """(in_proj_qkvz, in_proj_ba) for ``la``'s (this rank's) heads: Qwen3-Next's two checkpoint
    tensors as they are (rows grouped by key head, so a rank's are contiguous); Qwen3.5's four
    loaded as the shards of two merged projections (q/k/v then z; b then a), so each layout
    takes two GEMMs."""
    value_dim = la.num_value_heads * la.value_head_dim
    if la.separate_projections:
        return (
            SeparateQkvz(hidden, la, tp),
            MergedLinear(hidden, [tp.size * la.num_value_heads] * 2, False, tp),
        )
    return (
        column_parallel_linear(hidden, [tp.size * (la.conv_dim + value_dim)], False, tp),
        column_parallel_linear(hidden, [tp.size * 2 * la.num_value_heads], False, tp),
    )


class SeparateQkvz(MergedLinear):
    """Qwen3.5's in_proj_qkv and in_proj_z as one projection (``la`` is this rank's share of
    the heads). Under tensor parallelism each rank takes its key heads' rows of q and of k and
    its value heads' rows of v (in_proj_qkv holds q, k and v each whole, in head order, so a
    rank's rows are three runs) and its value heads' rows of z (one run)."""

    def __init__(self, hidden: int, la: LinearAttentionConfig, tp: TPGroup = SINGLE) -> None:
        value_dim = la.num_value_heads * la.value_head_dim
        super().__init__(hidden, [tp.size * la.conv_dim, tp.size * value_dim], False, tp)
        key_dim = la.num_key_heads * la.key_head_dim
        self.qkv_pieces = [tp.size * key_dim, tp.size * key_dim, tp.size * value_dim]

    def narrow_checkpoint(
        self, param_name: str, tensor: torch.Tensor, shard: int | None
    ) -> torch.Tensor:
        if shard != 0 or self.tp.size == 1:
            return super().narrow_checkpoint(param_name, tensor, shard)
        if param_name != "weight":
            raise ValueError(
                f"in_proj_qkv's {param_name} under --tensor-parallel-size {self.tp.size}: a "
                "quantized Qwen3.5 linear-attention projection has no tensor-parallel split yet"
            )
        parts = tensor.split(self.qkv_pieces, dim=0)
        return torch.cat([rank_rows(part, self.tp) for part in parts], dim=0)


def local_heads(config: ModelConfig, tp: TPGroup) -> LinearAttentionConfig:
    """The linear attention's heads on this rank: 1/size of the key heads, each with its value
    heads; a ValueError naming the count that does not divide."""
    la = config.linear_attention
    assert la is not None
    return dataclasses.replace(
        la,
        num_key_heads=check_divisible("linear-attention key heads", la.num_key_heads, tp),
        num_value_heads=check_divisible("linear-attention value heads", la.num_value_heads, tp),
    )


def conv_channels(la: LinearAttentionConfig, tp: TPGroup, weight: torch.Tensor) -> torch.Tensor:
    """This rank's channels of the convolution's checkpoint weight [C, 1, K]: its q, k and v
    channels, each from that block of the full weight (``la`` is this rank's share)."""
    key, value = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    blocks = weight.split([key * tp.size, key * tp.size, value * tp.size], dim=0)
    return torch.cat([rank_rows(block, tp) for block in blocks], dim=0)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dim scaled to unit length (eps inside the root, as HF and FLA do)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (plain weight), times silu of the gate z."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] -> [..., dim] in x's dtype (normalised in float32)."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one shared SwiGLU expert, scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, tp)
        width = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(dataclasses.replace(config, intermediate_size=width), tp)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen3NextDecoderLayer(nn.Module):
    """LlamaDecoderLayer's contract, its mixer either gated attention or a GatedDeltaNet."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn: LlamaAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if config.is_linear_attention_layer(layer):
            self.linear_attn = GatedDeltaNet(config, tp)
        else:
            self.self_attn = LlamaAttention(config, tp, layer)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        shared = config.is_moe_layer(layer) and config.shared_expert_intermediate_size
        self.mlp = SharedExpertMoE(config, tp) if shared else make_mlp(config, tp, layer)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = first_norm(self.input_layernorm, hidden, residual)
        if self.linear_attn is not None:
            mixed = self.linear_attn(normed)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(normed, cos, sin)
        hidden, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(hidden), residual


class Qwen3NextMtpLayer(nn.Module):
    """The multi-token-prediction layer a Qwen3-Next or Qwen3.5 checkpoint ships (``mtp.*``,
    names less that prefix, its decoder layer's under ``block.``), as vLLM's qwen3_next_mtp.py
    reads it: x = fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)]), one gated
    full-attention decoder layer of the target's kind (its MLP too), then ``norm``; the
    target's LM head reads that (engine_core/mtp.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = make_norm(config, hidden)
        self.pre_fc_norm_hidden = make_norm(config, hidden)
        # A torch Linear, as DeepSeek's eh_proj: kept in the model's dtype whatever the format.
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # The layer after the target's last, attending fully whatever the layer_types pattern.
        layer = config.num_layers
        kinds = (*(config.layer_types or ()), "full_attention")
        self.block = Qwen3NextDecoderLayer(
            dataclasses.replace(config, layer_types=kinds), layer=layer
        )
        self.norm = make_norm(config, hidden)

    @property
    def feature_size(self) -> int:
        return self.fc.out_features

    def forward(
        self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """embeds (of the tokens after the positions), feature (the target's final hidden
        states there, or this layer's previous output) [T, H] -> the normed output [T, H]."""
        inputs = [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(feature)]
        out, residual = self.block(self.fc(torch.cat(inputs, dim=-1)), None, cos, sin)
        return self.norm(out, residual)[0]

    def attention(self) -> nn.Module:
        assert self.block.self_attn is not None  # built fully attending
        return self.block.self_attn.attn


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next; checkpoint names follow HF's Qwen3NextForCausalLM."""

    decoder_layer = Qwen3NextDecoderLayer
    # A decode step reads no host value (the convolution's slots gathered and scattered by
    # index tensors, the delta rule in place on the slots: models/delta_rule_triton.py), so
    # decode steps replay CUDA graphs; a prompt chunk loops over sequences on the host, so
    # prompt steps run eagerly.
    prompt_graphs_safe = False

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn is not None]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.vision is None:  # a text-only build (models/qwen3_5_vl.py builds one)
            weights = without_vision_tower(weights)
        if self.tp.size > 1:
            weights = self.rank_conv_channels(weights)
        super().load_weights(weights)

    def rank_conv_channels(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream with each convolution weight cut to this rank's channels (nn.Conv1d
        splits nothing itself)."""
        layers = self.linear_attention_layers()
        for name, tensor in weights:
            if name.endswith(".linear_attn.conv1d.weight") and layers:
                tensor = conv_channels(layers[0].la, self.tp, tensor)
            yield name, tensor

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """HF's names, in the CausalLM layout or (Qwen3.5) the ConditionalGeneration one,
        whose language model sits under ``model.language_model.``."""
        if hf_name.startswith("mtp."):
            return None  # the multi-token-prediction head: a draft model, unused here
        if ".shared_expert" in hf_name and not self.config.shared_expert_intermediate_size:
            return None  # HF builds a shared expert of width 0 there: it adds exactly zero
        if hf_name.startswith("model.language_model."):
            hf_name = "model." + hf_name.removeprefix("model.language_model.")
        module, _, param = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in SEPARATE_PROJECTIONS:
            merged, shard = SEPARATE_PROJECTIONS[proj]
            return f"{parent}.{merged}.{param}", shard
        return super().map_name(hf_name)


def without_vision_tower(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but a Qwen3.5 ConditionalGeneration's vision tower
    (``model.visual.*``), for a build without it: a ConditionalGeneration checkpoint whose
    config has no ``vision_config``, which serves text only."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(VISION_TOWER_PREFIX):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info(
            "skipped the vision tower's %d tensors (%s*): the config has no vision_config, "
            "the model serves text",
            skipped, VISION_TOWER_PREFIX,
        )  # fmt: skip


def qwen3_next_fields(hf: dict[str, Any], arch: str = "Qwen3NextForCausalLM") -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-Next or Qwen3.5 (text) config.json beyond the Llama
    family's; ValueError naming any field whose value we do not implement."""
    refuse_unsupported(hf, arch, implemented=("shared_expert_intermediate_size",))
    for name in ("use_sliding_window", "sliding_window"):
        if hf.get(name) not in (None, False):
            raise ValueError(f"{arch}: config field {name}={hf[name]!r} is not supported")
    fields: dict[str, Any] = {
        "architecture": "qwen3_next",
        "qk_norm": True,
        "norm_unit_offset": True,
        "attention_output_gate": True,
        "layer_types": qwen3_next_layer_types(hf, arch),
        "linear_attention": linear_attention_config(hf, arch),
    }
    experts = hf.get("num_experts") or 0
    if not experts:
        return fields
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ValueError(
            f"{arch}: num_experts_per_tok ({top_k}) must be between 1 and num_experts ({experts})"
        )
    return fields | {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
        **expert_layout(hf, arch),
    }


def expert_layout(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Which layers are dense and whether the top-k weights renormalise. Qwen3.5's MoE has no
    such fields: every layer is sparse and its router always renormalises (HF's
    Qwen3_5MoeTopKRouter), so a config saying otherwise is refused rather than ignored."""
    if arch not in QWEN3_5_ARCHITECTURES:
        return {
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "dense_layers": qwen3_dense_layers(hf),
        }
    if hf.get("norm_topk_prob") is False:
        raise ValueError(f"{arch}: norm_topk_prob=False is not supported (Qwen3.5 renormalises)")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{arch}: mlp_only_layers / decoder_sparse_step are not supported (every Qwen3.5 "
            "MoE layer is sparse)"
        )
    return {"norm_topk_prob": True, "dense_layers": ()}


def qwen3_5_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 checkpoint's language-model config: ``text_config`` for a ConditionalGeneration
    one (its top level's ``tie_word_embeddings``, which HF ties by, its quantization_config,
    and its token ids where the text config lacks them), else the top level. An MoE config
    has no ``intermediate_size``: no layer has a dense MLP, whose width is then 0."""
    if "text_config" not in hf:
        return {"intermediate_size": 0} | hf
    text = {"intermediate_size": 0} | hf["text_config"]
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    text["quantization_config"] = hf.get("quantization_config")
    for key in ("eos_token_id", "bos_token_id"):
        if key in hf and text.get(key) is None:
            text[key] = hf[key]
    return text


def qwen3_next_layer_types(hf: dict[str, Any], arch: str) -> tuple[str, ...]:
    """``layer_types``, or from ``full_attention_interval`` (HF's default 4): every
    interval-th layer attends fully, the others are linear attention."""
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval", 4)
        kinds = [LAYER_KINDS[(i + 1) % interval == 0] for i in range(num_layers)]
    unknown = set(kinds) - set(LAYER_KINDS)
    if len(kinds) != num_layers or unknown:
        raise ValueError(f"{arch}: unsupported layer_types {kinds!r}")
    return tuple(kinds)


def linear_attention_config(hf: dict[str, Any], arch: str) -> LinearAttentionConfig:
    la = LinearAttentionConfig(
        num_key_heads=hf.get("linear_num_key_heads", 16),
        num_value_heads=hf.get("linear_num_value_heads", 32),
        key_head_dim=hf.get("linear_key_head_dim", 128),
        value_head_dim=hf.get("linear_value_head_dim", 128),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        separate_projections=arch in QWEN3_5_ARCHITECTURES,
    )
    if la.num_value_heads % la.num_key_heads:
        raise ValueError(
            f"{arch}: linear_num_value_heads ({la.num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({la.num_key_heads})"
        )
    if la.conv_kernel < 2:
        raise ValueError(f"{arch}: linear_conv_kernel_dim {la.conv_kernel} is not supported "
                         "(at least 2)")  # fmt: skip
    return la
