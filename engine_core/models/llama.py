"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3;
and the pieces Gemma 3 (models/gemma3.py) shares.

One implementation, switched by ModelConfig flags: ``attention_bias`` (Qwen2's q/k/v bias),
``qk_norm`` (Qwen3's per-head RMSNorm on q and k, before rotary), ``sliding_window`` (Mistral,
Phi-3; per layer through ``layer_types``), ``partial_rotary_factor`` and LongRoPE (Phi-3),
``local_rope_theta`` (a second rope for the sliding layers), ``norm_unit_offset``,
``embedding_scale``, ``attention_scale``, ``final_logit_softcapping`` and ``hidden_act`` (Gemma).
q/k/v and gate/up are each one merged linear; ``load_weights`` maps HF's separate tensors into
their rows (Phi-3's fused ones are split first). Parameter names otherwise follow HF, so the
mapping stays a few renames.

Under tensor parallelism (engine_core/parallel.py) each rank holds 1/N of the attention heads and
KV heads (column-parallel qkv_proj, row-parallel o_proj), 1/N of the MLP (column-parallel
gate_up_proj, row-parallel down_proj) and 1/N of the vocabulary (embedding and LM head); norms and
rotary are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine_core.attention.layer import Attention
from engine_core.config import ModelConfig
from engine_core.models.aux_hidden import AuxHiddenStates
from engine_core.models.fp8 import FP8_DTYPE, fp8_kernels, takes_fp8_rows
from engine_core.models.gate_up_layout import GLU_HALF, interleave_gate_up
from engine_core.models.gguf_layers import GgufEmbedding
from engine_core.models.gpt_oss_moe import GptOssMoE
from engine_core.models.int8 import takes_int8_rows
from engine_core.models.layers import (
    ACT_AND_MUL,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    attach_rows,
    check_divisible,
    interleaved_silu_glu,
    lm_head,
    load_mapped_weights,
    norm_and_rotate_qk,
    norm_between,
    project_logits,
    row_parallel_linear,
    silu_and_mul,
    vocab_embedding,
)
from engine_core.models.moe import SparseMoE, map_moe_name
from engine_core.models.pipeline import MissingLayer
from engine_core.models.target import BuildTarget
from engine_core.parallel import (
    SINGLE,
    PendingSum,
    PipelineStage,
    TPGroup,
    get_pipeline_stage,
    get_tp_group,
)

# HF projection name -> (our merged projection, shard index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# A checkpoint's fused projection (Phi-3) -> the HF names of the blocks its rows stack, in order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def make_norm(config: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.norm_eps, config.norm_unit_offset)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # Qwen3-Next: each head's query rows are followed by as many rows of its output gate.
        self.output_gate = config.attention_output_gate
        q_rows = heads * head_dim * (2 if self.output_gate else 1)
        sizes = [q_rows, kv_heads * head_dim, kv_heads * head_dim]
        # This rank's heads and KV heads (all of them at TP=1).
        heads = check_divisible("number of attention heads", heads, tp)
        kv_heads = check_divisible("number of KV heads", kv_heads, tp)
        self.qkv_proj = MergedLinear(config.hidden_size, sizes, config.attention_bias, tp)
        self.sizes = self.qkv_proj.output_sizes  # this rank's q, k, v widths
        self.o_proj = row_parallel_linear(
            config.num_heads * head_dim, config.hidden_size, has_o_bias(config), tp
        )
        self.q_norm = make_norm(config, head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, head_dim) if config.qk_norm else None
        scale = config.attention_scale or head_dim**-0.5
        window = config.layer_sliding_window(layer)
        self.attn = Attention(
            heads,
            kv_heads,
            head_dim,
            scale,
            window,
            config.attention_sinks,
            attention_chunk=config.layer_attention_chunk(layer),
        )

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | PendingSum:
        """hidden [T, hidden], cos/sin [T, D] -> [T, hidden] (a PendingSum where o_proj defers
        its all-reduce to the norm after it)."""
        return self.o_proj(self.attend(self.qkv_proj(hidden), cos, sin))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qkv_proj's output [T, q + k + v] -> the attention's output [T, H*D], before o_proj
        (with an output gate: times the sigmoid of the gate)."""
        num_tokens, head_dim = qkv.shape[0], self.attn.head_dim
        q, k, v = qkv.split(self.sizes, dim=-1)
        if self.output_gate:
            q, gate = q.reshape(num_tokens, -1, 2 * head_dim).chunk(2, dim=-1)
            out = self.attend_qkv(q.reshape(num_tokens, -1), k, v, cos, sin)
            return out * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.attend_qkv(q, k, v, cos, sin)

    def attend_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H*D], k and v [T, KVH*D] -> the attention's output [T, H*D]."""
        num_tokens, head_dim = q.shape[0], self.attn.head_dim
        if self.q_norm is None and self.attn.rotates_in_kv_write():
            return self.attn(q, k, v, rotary=(cos, sin))  # one launch for both
        q = q.view(num_tokens, -1, head_dim)  # [T, H, D]
        k = k.view(num_tokens, -1, head_dim)  # [T, KVH, D]
        q, k = norm_and_rotate_qk(q, k, self.q_norm, self.k_norm, cos, sin)  # in place on CUDA
        return self.attn(q.flatten(1), k.flatten(1), v)


def has_o_bias(config: ModelConfig) -> bool:
    """HF Llama and Qwen3 put ``attention_bias`` on o_proj too; Qwen2 has q/k/v bias only."""
    return config.attention_bias and config.hf_config.get("model_type") != "qwen2"


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], False, tp)
        self.down_proj = row_parallel_linear(size, config.hidden_size, False, tp)
        self.act_and_mul = ACT_AND_MUL[config.hidden_act]
        # Chosen when the model is built for its target (choose_layer_forms), never after: with
        # an FP8 or INT8 down_proj that quantizes its input per token and a SiLU activation,
        # prefill-sized batches quantize in the SiLU launch (to this dtype); with interleaved
        # gate/up rows (on Hopper, with CUDA graphs) the SiLU-and-mul rides in the skinny
        # GEMM's epilogue.
        self.quantize_act: torch.dtype | None = None
        self.gate_up_interleaved = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | PendingSum:
        if self.gate_up_interleaved:
            return self.down_proj(interleaved_silu_glu(x, self.gate_up_proj.weight))
        gate_up = self.gate_up_proj(x)
        if self.quantize_act and gate_up.dim() == 2:
            kernels = fp8_kernels()
            if gate_up.shape[0] >= kernels.FUSED_ACT_QUANT_MIN_ROWS:
                act, q, scale = kernels.silu_and_mul_quant(gate_up, self.quantize_act)
                return self.down_proj(attach_rows(act, (q, scale)))
        return self.down_proj(self.act_and_mul(gate_up))


def make_mlp(config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: a mixture of experts where the config has one (Mixtral, Qwen3-MoE;
    engine_core/models/moe.py; gpt-oss's, models/gpt_oss_moe.py), else dense."""
    if config.is_moe_layer(layer) and config.moe_router == "gpt_oss":
        return GptOssMoE(config, tp)
    if config.is_moe_layer(layer):
        return SparseMoE(config, tp)
    return LlamaMLP(config, tp)


def first_norm(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm: (normed, residual stream). The first layer has no residual
    yet (its input is the stream); later layers add theirs inside the norm."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = LlamaAttention(config, tp, layer)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = make_mlp(config, tp, layer)

    def forward(
        self,
        hidden: torch.Tensor | PendingSum,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """(previous sublayer's output, residual stream before it; None for the first layer)
        -> (this layer's MLP output, residual stream before it), each [T, hidden]: every
        residual add happens inside the next norm (and under tensor parallelism, where
        defer_row_parallel_sums set it up, the sublayers' all-reduces too)."""
        attn = self.self_attn
        normed, residual = first_norm(self.input_layernorm, hidden, residual)
        heads = attn.attend(attn.qkv_proj(normed), cos, sin)  # before o_proj: mlp_block's
        return self.mlp_block(heads, residual)

    def mlp_block(
        self, heads: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """o_proj, the post-attention norm and the MLP: (the MLP's output, the residual stream).
        In a CUDA graph the norm rides in o_proj's and gate_up_proj's launches (with the
        SiLU-and-mul) where norm_between takes them."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        if isinstance(mlp, LlamaMLP) and mlp.gate_up_interleaved:
            fused = norm_between(attn.o_proj, heads, residual, norm, mlp.gate_up_proj, glu=True)
            if fused is not None:
                act, residual = fused
                return mlp.down_proj(act), residual
        hidden, residual = norm(attn.o_proj(heads), residual)
        return mlp(hidden), residual


def choose_layer_forms(model: nn.Module, target: BuildTarget) -> None:
    """Give a Llama-family model, built and not yet loaded, the forms its layers take on
    ``target`` (see models/target.py): on CUDA, fused FP8 and INT8 input quantizers, deferred
    tensor-parallel sums and, on Hopper with CUDA graphs and no LoRA, interleaved gate/up rows."""
    if not target.on_cuda:
        return
    fuse_quantizers(model)  # before the interleaving, which skips an MLP that fused
    defer_row_parallel_sums(model)
    if target.cuda_graphs and target.hopper and not target.lora:
        interleave_gate_ups(model)


def quantized_input(linear: nn.Module) -> torch.dtype | None:
    """The per-token form a linear quantizes its input to (e4m3: models/fp8.py takes_fp8_rows;
    int8: models/int8.py takes_int8_rows), which the kernel before it can write instead; None."""
    if takes_fp8_rows(linear):
        return FP8_DTYPE
    return torch.int8 if takes_int8_rows(linear) else None


def fuse_quantizers(model: nn.Module) -> int:
    """Let the kernels in front of FP8 or INT8 linears that quantize their input per token write
    that form themselves: a Llama-layout layer's input norm (for qkv_proj), its post-attention
    norm (for a dense MLP's gate_up_proj), and a SiLU MLP's activation (for down_proj) in
    prefill-sized batches only: it takes one program a row, which at decode batches was slower
    than the two launches (docs/design/kernels-and-limits.md, "FP8" and "Tried and dropped").
    Saves one quantizer launch each; returns how many."""
    fused = 0
    for layer in model.modules():
        if type(layer) is not LlamaDecoderLayer:  # other layouts place their norms elsewhere
            continue
        dtype = quantized_input(layer.self_attn.qkv_proj)
        if isinstance(layer.input_layernorm, RMSNorm) and dtype is not None:
            layer.input_layernorm.quantize_output = dtype
            fused += 1
        mlp = layer.mlp  # a mixture of experts is left alone: its router reads the norm
        if not isinstance(mlp, LlamaMLP):
            continue
        norm, dtype = layer.post_attention_layernorm, quantized_input(mlp.gate_up_proj)
        if isinstance(norm, RMSNorm) and dtype is not None:
            norm.quantize_output = dtype
            fused += 1
        dtype = quantized_input(mlp.down_proj)
        if mlp.act_and_mul is silu_and_mul and dtype is not None:
            mlp.quantize_act = dtype
            fused += 1
    return fused


def interleave_gate_ups(model: nn.Module) -> int:
    """Mark every dense SiLU MLP with a plain bf16/fp16 gate/up weight (no bias, unquantized) for
    the interleaved row layout (models/skinny_gemm.py interleave_gate_up), so that decode steps in
    CUDA graphs compute silu(gate) * up in the gate/up product's epilogue: one launch and one
    round trip of the product fewer per layer (eager steps take cuBLAS either way). An MLP whose
    SiLU launch quantizes for an FP8 down_proj keeps its layout. The rows move once the weights
    are in (``interleave_loaded_gate_ups``); returns how many were marked."""
    marked = 0
    for mlp in model.modules():
        if not isinstance(mlp, LlamaMLP) or mlp.act_and_mul is not silu_and_mul:
            continue
        if mlp.quantize_act:  # a down_proj whose quantizer rides in the SiLU launch
            continue
        proj = mlp.gate_up_proj
        if proj.quantized or proj.bias is not None:
            continue
        weight = proj.weight
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.shape[0] % (2 * GLU_HALF):
            continue
        mlp.gate_up_interleaved = True
        marked += 1
    return marked


def interleave_loaded_gate_ups(model: nn.Module) -> None:
    """Move the loaded gate/up rows of the MLPs ``interleave_gate_ups`` marked into that layout
    (the plain weights' memory goes back to the allocator)."""
    moved = False
    for mlp in model.modules():
        if isinstance(mlp, LlamaMLP) and mlp.gate_up_interleaved:
            weight = mlp.gate_up_proj.weight
            mlp.gate_up_proj.weight = nn.Parameter(
                interleave_gate_up(weight.data), requires_grad=False
            )
            moved = True
    if moved:
        torch.cuda.empty_cache()  # the plain weights' blocks: not counted as used by KV sizing


def defer_row_parallel_sums(model: nn.Module) -> int:
    """Under tensor parallelism with the peer all-reduce (engine_core/peer_all_reduce.py), let a
    Llama-layout layer's o_proj and a dense MLP's down_proj leave their all-reduce to the RMSNorm
    that takes their output next, with the residual: the post-attention norm, and the next
    layer's input norm or the final norm. That norm then sums the ranks' rows in its own launch,
    one launch and one pass over the rows fewer per all-reduce. Returns how many were deferred."""
    deferred = 0
    for llama in model.modules():
        if not isinstance(llama, LlamaModel):
            continue
        if any(type(layer) is not LlamaDecoderLayer for layer in llama.layers):
            continue  # other layouts (Gemma 3) normalize a sublayer's output without a residual
        for layer in llama.layers:
            projections = [layer.self_attn.o_proj]
            if isinstance(layer.mlp, LlamaMLP):  # a mixture of experts sums its own output
                projections.append(layer.mlp.down_proj)
            for proj in projections:
                peer = isinstance(proj, RowParallelLinear) and proj.tp.peer is not None
                if peer and proj.bias is None:
                    proj.defer_sum = True
                    deferred += 1
    return deferred


class LlamaModel(nn.Module):
    """The decoder body, or under pipeline parallelism one stage of it: the stage's layers (the
    others are MissingLayers), the embedding on the first stage and the final norm on the last
    (a tied LM head keeps the embedding there too)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup = SINGLE,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.stage = get_pipeline_stage()  # read once, as the tensor-parallel group is
        self.stage_layers = self.stage.layers(config.num_layers)
        self.hidden_size = config.hidden_size
        self.dtype = torch.get_default_dtype()  # the activations' between stages
        tied_head = self.stage.is_last and config.tie_word_embeddings
        self.embed_tokens = (
            vocab_embedding(config.vocab_size, config.hidden_size, tp)
            if self.stage.is_first or tied_head
            else MissingLayer()
        )
        self.embedding_scale = config.embedding_scale
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)
        # Gemma 3: the sliding layers rotate with their own base; the global ones with rotary_emb.
        self.local_rotary_emb = None
        if config.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(
                config.rotary_dim, config.local_rope_theta, config.local_rope_scaling
            )
        self.uses_local_rope = [
            self.local_rotary_emb is not None and kind == "sliding_attention"
            for kind in config.layer_types or ["full_attention"] * config.num_layers
        ]
        self.layers = nn.ModuleList(
            layer_class(config, tp, i) if i in self.stage_layers else MissingLayer()
            for i in range(config.num_layers)
        )
        self.norm = make_norm(config, config.hidden_size) if self.stage.is_last else MissingLayer()
        # Where an EAGLE-3 head drafts from this model, the runner's buffer for the residual
        # stream entering its chosen layers (models/aux_hidden.py); None: no taps, no cost.
        self.aux_hidden_states: AuxHiddenStates | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; Gemma scales by sqrt(hidden) rounded to the embedding's
        dtype first, as HF does (in bf16 sqrt(3072) becomes 55.5)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is None:
            return hidden
        return hidden * float(torch.tensor(self.embedding_scale, dtype=hidden.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, hidden]; on a pipeline stage before the last, the
        stage's output for the next one: the hidden state and the residual stream,
        [2, T, hidden] (the runner hands it on, engine_core/parallel.py PipelineStage)."""
        hidden, residual = self.stage_input(input_ids)  # [T, hidden] each; no residual yet
        return self.run_layers(hidden, residual, positions)

    def run_layers(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor:
        """The stage's layers over its input (``forward``'s, or embeddings a vision-language
        model filled in, models/gemma3_mm.py), then the final norm on the last stage."""
        rope = self.rotary_emb(positions, hidden.dtype)  # (cos, sin), [T, rotary_dim] each
        local = (
            rope
            if self.local_rotary_emb is None
            else self.local_rotary_emb(positions, hidden.dtype)
        )
        aux = self.aux_hidden_states
        for i in self.stage_layers:
            if aux is not None and i in aux.columns:
                aux.keep(i, hidden, residual)
            cos, sin = local if self.uses_local_rope[i] else rope
            hidden, residual = self.layers[i](hidden, residual, cos, sin)
        if not self.stage.is_last:
            # No deferred sum reaches here: the peer all-reduce is off with pipeline stages.
            return torch.stack((hidden, residual))
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def stage_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual stream): the embedding on the first stage, else what the previous
        stage handed on."""
        if self.stage.is_first:
            return self.embed(input_ids), None
        size, device = self.hidden_size, input_ids.device
        return self.stage.recv_activations(input_ids.shape[0], size, self.dtype, device)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder; see the module docstring for the variants it covers."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # a family's own layer (Gemma 3)
    model_class: type[LlamaModel] = LlamaModel  # a family's own body (Llama 4's query scales)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()  # the tensor-parallel group this process builds for, read once
        self.model = self.model_class(config, self.tp, self.decoder_layer)
        self.lm_head = make_lm_head(config, self.tp, self.model.stage)
        self.packed_logits_weight: torch.Tensor | None = None  # CPU: pack_cpu_weights sets it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def logits_weight(self) -> torch.Tensor | None:
        """The LM head's matrix [vocab (this rank's), hidden]: the embedding's when tied; None
        on a pipeline stage before the last, and where the head is GGUF blocks (``gguf_head``)."""
        if not self.model.stage.is_last or self.gguf_head() is not None:
            return None
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def gguf_head(self) -> GgufEmbedding | None:
        """A tied LM head held as the embedding's GGUF blocks, which multiply by themselves."""
        embed = self.model.embed_tokens
        return embed if self.lm_head is None and isinstance(embed, GgufEmbedding) else None

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 on rank 0 (None on the other ranks);
        ``widen=False``: in the weights' dtype where nothing else needs float32. With pipeline
        stages the last one computes them and sends them to rank 0, whose ``hidden`` rows only
        give their number there."""
        cap = self.config.final_logit_softcapping
        stage = self.model.stage
        dtype = torch.float32 if widen or cap is not None else hidden.dtype  # rank 0 receives
        if not stage.is_last:
            return stage.recv_logits(hidden.shape[0], self.config.vocab_size, dtype, hidden.device)
        # The soft cap's tanh is computed in float32.
        logits = self.project_hidden(hidden, widen or cap is not None)
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        stage.send_logits(logits, dtype)
        return logits

    def project_hidden(self, hidden: torch.Tensor, widen: bool) -> torch.Tensor | None:
        """The LM head's product of this stage's ``hidden`` (``project_logits``)."""
        head = self.gguf_head()
        if head is not None:  # one rank: the loader keeps GGUF blocks only there
            logits = head.logits(hidden)
            return logits.float() if widen else logits
        weight, packed = self.logits_weight(), self.packed_logits_weight
        return project_logits(hidden, weight, self.tp, self.config.vocab_size, packed, widen)

    def plain_logits_weight(self) -> torch.Tensor | None:
        """The matrix W with logits == hidden @ W.T exactly (the decode graphs project them
        themselves), or None: under tensor parallelism (a gather), with pipeline stages (a
        send) or with a soft cap."""
        if self.tp.size > 1 or self.model.stage.size > 1:
            return None
        return None if self.config.final_logit_softcapping is not None else self.logits_weight()

    def attention_layers(self) -> list[Attention]:
        """This stage's layers' attention, in layer order (every layer's without stages)."""
        return [self.model.layers[i].self_attn.attn for i in self.model.stage_layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (q/k/v and gate/up separate or fused) into the merged layout."""
        load_mapped_weights(self, split_fused(weights, self.config), self.map_name)

    def map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith("lm_head.") and self.lm_head is None:
            return None  # some tied checkpoints still store the alias; an embedding model's unused
        if not hf_name.startswith(("model.", "lm_head.")):
            # A bare body's checkpoint (HF's *Model, as embedding models are saved) names its
            # tensors from the body down: "layers.0...", "embed_tokens.weight", "norm.weight".
            hf_name = "model." + hf_name
        if self.config.num_experts and (target := map_moe_name(hf_name)) is not None:
            return target
        module, _, param = hf_name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in _MERGED:
            merged, shard = _MERGED[proj]
            return f"{parent}.{merged}.{param}", shard
        return hf_name, None


def make_lm_head(config: ModelConfig, tp: TPGroup, stage: PipelineStage) -> nn.Module | None:
    """The LM head's weight holder; None where the model holds none: tied models read the
    embedding matrix directly rather than holding a second alias, and an embedding model
    (config.embedding) computes no logits. A MissingLayer on a pipeline stage before the last."""
    if config.tie_word_embeddings or config.embedding is not None:
        return None
    if not stage.is_last:
        return MissingLayer()
    return lm_head(config.vocab_size, config.hidden_size, tp)


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3 stores q/k/v and gate/up each as one tensor: split them by the full sizes into the
    separate names, so each block is loaded (and, under tensor parallelism, sliced for this
    rank) like a checkpoint that stores them apart."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [config.intermediate_size] * 2}
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in FUSED_PROJECTIONS:
            yield name, tensor
            continue
        if tensor.numel() == 1:  # an FP8 per-tensor scale: it holds for every block
            yield from ((f"{parent}.{block}.{param}", tensor) for block in FUSED_PROJECTIONS[proj])
            continue
        rows = sum(sizes[proj])
        if tensor.shape[0] != rows:
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, not {rows}")
        for block, part in zip(FUSED_PROJECTIONS[proj], tensor.split(sizes[proj]), strict=True):
            yield f"{parent}.{block}.{param}", part
