"""Typed, frozen configuration for the engine core.

ModelConfig describes the network (read from a Hugging Face config.json by the loader);
EngineConfig describes how the engine runs it. Both are frozen: whatever needs to change after
construction is derived in a property or built into a new object with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_core.profiler import check_profile_dir
from protocol.address import is_loopback_host
from protocol.messages import EmbeddingModel, SchedulingPolicy

if TYPE_CHECKING:
    from engine_core.speculative import SpeculativeConfig

# --quantization values: "fp8" and "w8a8" quantize a plain checkpoint as it loads; the others name
# the format of a quantized checkpoint (vLLM's names: the *_marlin ones mean the same checkpoints)
# and must agree with its quantization_config (engine_core/models/quant_config.py).
QUANTIZATION_METHODS = (
    "fp8",
    "w8a8",
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "compressed-tensors",
    "auto-round",
)
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype values; "fp8" is e4m3
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype values
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # --device values
TP_ALL_REDUCES = ("auto", "nccl")  # --tp-all-reduce values
# --seed: what torch.Generator.manual_seed takes (a 64-bit value, signed or not).
TORCH_SEED_MIN = -(2**63)
TORCH_SEED_MAX = 2**64 - 1
# --runner values (vLLM's): "auto" reads the checkpoint (engine_core/embedding.py), "generate"
# samples tokens, "pooling" embeds (the engine answers with each prompt's pooled vector).
RUNNERS = ("auto", "generate", "pooling")
# --scheduling-policy values (vLLM's): "fcfs" in arrival order, "priority" by each request's
# priority, then arrival (engine_core/scheduler.py).
SCHEDULING_POLICIES = tuple(p.flag_name for p in SchedulingPolicy)

# Sequences running at once where --max-num-seqs is unset (EngineConfig.with_max_num_seqs): on
# one host whose GPU has 70 GiB or more, as many as vLLM runs there (its API server's
# EngineArgs.get_batch_defaults), else 256. Under a load past what the GPU serves, more running
# rows trade a longer step for a shorter queue (docs/design/goodput-and-multi-turn.md).
DEFAULT_MAX_NUM_SEQS = 256
LARGE_GPU_MAX_NUM_SEQS = 1024
# --max-num-batched-tokens unset: DEFAULT_MAX_NUM_BATCHED_TOKENS, and CPU_MAX_NUM_BATCHED_TOKENS
# on the CPU, where a whole 8k prompt's step took 25-30 s on two cores (the engine announces
# such a step: engine_core/step_clock.py); in 4,096-token chunks the prompt took as long in all
# and the CPU benchmark's workloads ran as fast, 64 prompts at once reaching their first token
# sooner (docs/design/cpu-backend.md, "A smaller step budget on the CPU").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 4096
LARGE_GPU_BYTES = 70 * 2**30


@dataclass(frozen=True)
class Fp8Config:
    """How a model's linear layers hold FP8 (e4m3) weights (engine_core/models/fp8.py).

    ``weight_scales``: "channel" (one scale per output row; a checkpoint's per-tensor scales are
    spread over their rows, which dequantizes to the same values) or "block" (one scale per
    ``block`` = (rows, columns) tile, the block-wise format). ``dynamic_activations``: each
    token's activations get their own scale at run time, else the checkpoint's static
    ``input_scale``. ``prequantized``: the checkpoint holds FP8 weights and scales; otherwise its
    bf16/fp16/fp32 weights are quantized as they load (``--quantization fp8``).
    """

    weight_scales: str  # "channel" | "block"
    dynamic_activations: bool = True
    prequantized: bool = False
    block: tuple[int, int] | None = None
    source: str = "--quantization fp8"  # named in error messages
    # Checkpoint module names (HF's) left in the model's dtype, as the checkpoint lists them.
    ignore: tuple[str, ...] = ()  # as regular expressions over full module names
    kv_scales: bool = False  # the checkpoint holds FP8 K/V scales (self_attn.k_scale, v_scale)

    def __post_init__(self) -> None:
        if self.weight_scales not in ("channel", "block"):
            raise ValueError(f"unknown FP8 weight scale layout {self.weight_scales!r}")
        if (self.weight_scales == "block") != (self.block is not None):
            raise ValueError("FP8 block scales need a block shape, and only they have one")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, Kimi-K2; models/deepseek.py).

    Each token caches ``kv_lora_rank`` latent values and one ``qk_rope_head_dim`` rotary key
    shared by every head; ``kv_b_proj`` expands the latent into each head's no-rope key
    (``qk_nope_head_dim``) and value (``v_head_dim``). ``q_lora_rank`` None: q is one projection.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True  # rotary over (even, odd) pairs, as DeepSeek's weights expect

    @property
    def cache_width(self) -> int:
        """Elements one token holds in a layer's latent cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet's sizes (Qwen3-Next's and Qwen3.5's linear-attention layers;
    models/qwen3_next.py).

    Each layer keeps, per request, a state of fixed size whatever the context: the last
    ``conv_kernel - 1`` inputs of its causal depthwise convolution over q, k and v, and the
    recurrent state ``[value_heads, key_head_dim, value_head_dim]`` of the delta rule.
    ``separate_projections``: the checkpoint stores q/k/v, z, b and a as four tensors, each in
    head order (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), rather
    than two grouped by key head (Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    separate_projections: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k of every key head, v of every value head."""
        keys = self.num_key_heads * self.key_head_dim
        return 2 * keys + self.num_value_heads * self.value_head_dim

    @property
    def state_elements(self) -> int:
        """Elements of one layer's state for one request (convolution and recurrent)."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return self.conv_dim * (self.conv_kernel - 1) + recurrent


@dataclass(frozen=True)
class W4A16Config:
    """4-bit integer weights, 16-bit activations (engine_core/models/w4a16.py): AWQ, GPTQ and
    compressed-tensors pack-quantized checkpoints, repacked once at load into one layout.

    ``source`` names the checkpoint layout ("awq", "gptq", "compressed-tensors"). Each group of
    ``group_size`` input columns of an output row has a scale (-1: one group spans the whole
    input); with ``zero_points`` the checkpoint stores a zero point per group, else it is 8 (the
    middle of 0..15). ``act_order``: the checkpoint's ``g_idx`` assigns columns to groups (GPTQ
    desc_act). ``zero_offset``: what to add to a stored zero point (GPTQ's original format stores
    zero - 1). A weight is ``(q - zero) * scale``. ``origin``: the tool whose config declared
    the checkpoint when that is not the layout's own ("auto-round": AutoRound packs in GPTQ's or
    AWQ's layout); messages, ``--quantization`` and the tested-format lists name it.
    """

    source: str
    group_size: int
    zero_points: bool
    act_order: bool = False
    zero_offset: int = 0
    origin: str = ""
    ignore: tuple[str, ...] = ()  # as Fp8Config.ignore
    kv_scales: bool = False  # as Fp8Config.kv_scales (compressed-tensors' kv_cache_scheme)

    def __post_init__(self) -> None:
        if self.source not in ("awq", "gptq", "compressed-tensors"):
            raise ValueError(f"unknown W4A16 checkpoint layout {self.source!r}")
        if self.group_size != -1 and self.group_size < 8:
            raise ValueError(f"W4A16 group size {self.group_size} is not -1 or at least 8")


@dataclass(frozen=True)
class Int8Config:
    """W8A8 INT8 (engine_core/models/int8.py): int8 weights with one scale per output row (a
    per-tensor scale is spread over the rows), and activations quantized to int8 per token at
    run time (symmetric, scale = absmax / 127.5, as compressed-tensors computes it).
    ``prequantized`` False: a plain checkpoint is quantized as it loads."""

    prequantized: bool = True
    source: str = "compressed-tensors"
    ignore: tuple[str, ...] = ()  # as Fp8Config.ignore
    kv_scales: bool = False


# The weight format of a model's linear layers; None in ModelConfig: the model's dtype.
QuantConfig = Fp8Config | W4A16Config | Int8Config


def is_ignored(module_name: str, config: QuantConfig) -> bool:
    """Whether checkpoint module ``module_name`` stays unquantized under ``config``."""
    return any(re.fullmatch(pattern, module_name) for pattern in config.ignore)


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side (engine_core/multimodal.py): its vision tower's
    config as the checkpoint has it, the prompt's placeholder token for an image's embeddings,
    how many patches (per side) merge into one of them, and M-RoPE's split of each head's
    rotary frequencies among the temporal, height and width positions (empty: plain positions,
    Gemma 3). ``bidirectional_images``: an image's tokens attend to each other both ways (Gemma
    3), so an image's run is never split across chunks; ``tokens_per_image``: where every image
    has the same count (Gemma 3's mm_tokens_per_image), that count, else 0;
    ``max_image_tokens``: the largest image the engine plans memory for and takes (Gemma 3's
    one size; Qwen2.5-VL's processor's default bound, 12,845,056 pixels: 16,384 tokens).
    ``mrope_interleaved``: M-RoPE's sections interleaved over the frequencies (Qwen3-VL), not
    in consecutive chunks; ``deepstack_layers``: how many of the language model's first layers
    take DeepStack features (Qwen3-VL): an image token's embedding is then that many more
    rows of the language model's width, after its own. ``row_breaks``: each row of an image's
    merged grid is followed by one token the image does not fill (Pixtral's ``[IMG_BREAK]``,
    the last row's ``[IMG_END]``), inside the image's run."""

    tower: dict[str, Any] = field(compare=False, repr=False)
    image_token_id: int = 0
    spatial_merge_size: int = 2
    mrope_section: tuple[int, ...] = ()
    bidirectional_images: bool = False
    tokens_per_image: int = 0
    max_image_tokens: int = 16_384
    mrope_interleaved: bool = False
    deepstack_layers: int = 0
    row_breaks: bool = False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Phi-3), "gemma3", "gpt2",
    # "gpt_oss", "deepseek" (DeepSeek-V2/V3, Kimi-K2), "qwen3_next" (Qwen3-Next, Qwen3.5's
    # text), "llama4" (Llama 4's text)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # Mistral; honoured by attention when set
    # Per layer "sliding_attention" or "full_attention" (Gemma 3): only the sliding layers get
    # sliding_window. None: every layer gets it (Mistral, Phi-3). "linear_attention" (Qwen3-Next):
    # a gated DeltaNet layer, which has no KV cache but a state (``linear_attention``).
    # "chunked_attention" (Llama 4): the layer gets attention_chunk_size.
    layer_types: tuple[str, ...] | None = None
    attention_chunk_size: int | None = None  # Llama 4: a query at p sees [p // C * C, p]
    # Llama 4 (models/llama4.py): layers without rotary ("NoPE"); their queries' temperature
    # (floor_scale, attn_scale), None: unscaled; an L2 norm of q and k on the rotary layers.
    nope_layers: tuple[int, ...] = ()
    query_temperature: tuple[float, float] | None = None
    qk_l2_norm: bool = False
    # Gemma 3's sliding layers rotate with their own base (and scaling); None: one rope for all.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # Phi-3 family: rotary on the first part of each head
    norm_unit_offset: bool = False  # Gemma: RMSNorm weight w is applied as (1 + w)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Mixture of experts (Mixtral, Qwen3-MoE; engine_core/models/moe.py). num_experts 0: every
    # layer has a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's width (intermediate_size: the dense MLP's)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (Qwen3-MoE)
    # How the router picks experts: "softmax" (top-k of the softmax: Mixtral, Qwen3-MoE),
    # "gpt_oss" (softmax over the top-k logits, biased router, experts with biases and a clamped
    # SwiGLU), "llama4" (sigmoid of the top-1 logit, scaling the expert's input; a shared
    # expert), "sigmoid_grouped" (DeepSeek-V3: sigmoid scores, correction bias, top groups),
    # "softmax_grouped" (DeepSeek-V2: softmax scores, optionally the top groups' experts only).
    moe_router: str = "softmax"
    n_group: int = 1  # expert groups, of which each token's experts come from topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' weights times this (DeepSeek)
    n_shared_experts: int = 0  # DeepSeek: a dense MLP of n x moe_intermediate_size beside them
    swiglu_limit: float = 7.0  # gpt-oss: gate clamped above, up both sides, at this
    swiglu_alpha: float = 1.702  # gpt-oss: the sigmoid's gain in gate * sigmoid(alpha * gate)
    expert_format: str = "dense"  # "mxfp4": gpt-oss's experts held as e2m1 blocks + e8m0 scales
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    mla: MlaConfig | None = None  # DeepSeek's multi-head latent attention
    # Qwen3-Next: the gated DeltaNet layers' sizes, and the shared expert beside the routed ones
    # (a SwiGLU of this width, scaled by sigmoid(shared_expert_gate(x))); 0: none.
    linear_attention: LinearAttentionConfig | None = None
    shared_expert_intermediate_size: int = 0
    # Qwen3-Next: q_proj also yields a gate per head dim, the attention output times its sigmoid.
    attention_output_gate: bool = False
    hidden_act: str = "silu"
    quantization: QuantConfig | None = None  # None: weights in the model's dtype
    # GGUF on CUDA: (HF tensor name, block type) of the tensors the loader hands over as raw block
    # rows (engine_core/models/gguf.py); the layers that hold all their parts so keep them.
    gguf_blocks: tuple[tuple[str, str], ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Set where the engine runs the model as an embedding model (the loader decides, from the
    # checkpoint and --runner): how it pools. Such a model is built without its LM head.
    embedding: EmbeddingModel | None = None
    # An embedding model's sentence-transformers max_seq_length: the longest input it was made
    # for (sentence-transformers cuts inputs there; vLLM caps max_model_len at it, as we do).
    max_input_tokens: int | None = None
    vision: VisionConfig | None = None  # a vision-language model's image side
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the model takes: its positions, or an embedding model's
        ``max_input_tokens`` where that is shorter."""
        limit = self.max_position_embeddings
        return limit if self.max_input_tokens is None else min(limit, self.max_input_tokens)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_attention_chunk(self, layer: int) -> int | None:
        """The attention chunk of layer ``layer`` (None: the layer is not chunked)."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` is a linear-attention (gated DeltaNet) layer: no KV cache."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers that attend over a KV cache (every layer but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_attention_layer(i))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotary embedding rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (else dense)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer has a dense MLP of ``intermediate_size``."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 2 bytes an element (bf16)."""
        return self.kv_bytes_per_token_at(2)

    def kv_bytes_per_token_at(self, element_bytes: int) -> int:
        """Bytes of K and V per token over all layers at ``element_bytes`` an element."""
        return self.kv_elements_per_token(self.num_kv_heads) * element_bytes

    def kv_elements_per_token(self, num_kv_heads: int) -> int:
        """Cache elements per token over all attention layers for ``num_kv_heads`` KV heads
        (this rank's): K and V of every head; with MLA, the latent and rotary key alone, whatever
        the heads. Linear-attention layers hold a state per request instead (no KV cache)."""
        layers = len(self.attention_layer_ids)
        if self.mla is not None:
            return layers * self.mla.cache_width
        return 2 * layers * num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the two memory settings below
    kv_cache_memory_gb: float = 1.0  # CPU only
    gpu_memory_utilization: float = 0.9  # GPU only; vLLM's default
    # None: resolved as the runner starts (engine_core/model_runner.py resolve_max_num_seqs):
    # LARGE_GPU_MAX_NUM_SEQS on one host whose GPU has LARGE_GPU_BYTES or more, else
    # DEFAULT_MAX_NUM_SEQS, never past max_num_batched_tokens.
    max_num_seqs: int | None = None
    # None: resolved as the runner starts (engine_core/model_runner.py resolve_max_num_seqs):
    # CPU_MAX_NUM_BATCHED_TOKENS on the CPU, else DEFAULT_MAX_NUM_BATCHED_TOKENS; read it as
    # ``token_budget``.
    max_num_batched_tokens: int | None = None
    prefill_max_batch_size: int | None = None  # None: same as max_num_seqs
    enable_prefix_caching: bool = True
    # A host-memory tier of this many GiB for prefix-cache blocks evicted from the device pool
    # (engine_core/kv_offload.py; pinned on CUDA); 0: none.
    kv_offload_gb: float = 0.0
    # Linear-attention models (Qwen3-Next): saved states kept for prefix-cache hits
    # (engine_core/state_snapshots.py); None: as many as max_num_seqs; 0: no prefix caching.
    state_snapshots: int | None = None
    enforce_eager: bool = False
    # Steps with prompt tokens of up to this many tokens replay a CUDA graph
    # (engine_core/cuda_graph.py); 0: they run eagerly. Capped at max_num_batched_tokens. None:
    # 2048, and up to max_num_batched_tokens where start-up measures the host slower to launch
    # a 2048-token step eagerly than the GPU would be to run a whole step's tokens (a small
    # model: cuda_graph.py, extends_prefill_graphs).
    max_prefill_graph_tokens: int | None = None
    seed: int | None = 0  # None (the offline API only): a random seed each start
    # Overlap: schedule and prepare step N+1 while the GPU runs step N (engine_core/core.py).
    # None: on with a GPU or pipeline stages, else off on the CPU (EngineCore decides), where
    # the forward runs on the loop's own thread: overlap would only send each step's tokens a
    # step late. With pipeline stages the later stages run in their own processes, and
    # overlapped steps keep them busy together.
    async_scheduling: bool | None = None
    step_stats: bool = False  # per-step host/GPU timing, logged periodically (step_stats.py)
    nvtx: bool = False  # NVTX ranges around the parts of each step, for Nsight Systems
    # torch.profiler traces between POST /start_profile and /stop_profile go into this directory
    # (engine_core/profiler.py); None: those routes are refused.
    profile_dir: str | None = None
    tensor_parallel_size: int = 1  # processes (GPUs) one engine core shards the model over
    # Stages the decoder layers split into, each run by tensor_parallel_size processes
    # (engine_core/parallel.py split_layers); the engine core is tp x pp processes.
    pipeline_parallel_size: int = 1
    # "auto": small all-reduces over peer-to-peer GPU memory where the GPUs allow it, NCCL for
    # the rest (engine_core/peer_all_reduce.py); "nccl": NCCL for all of them.
    tp_all_reduce: str = "auto"
    data_parallel_size: int = 1  # engine cores behind one `tandem serve` (frontend only)
    # One engine's tensor-parallel group over several hosts (engine_core/nodes.py): node 0 runs
    # the engine core (and the API), the others only their ranks, all meeting at
    # master_addr:master_port; a non-loopback master_addr needs the shared dist_secret_file.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    dist_secret_file: str | None = None
    dist_timeout: float = 600.0  # seconds a node waits for the others at a rendezvous
    # MoE layers: each tensor-parallel rank holds 1/size of the experts, whole (models/moe.py).
    enable_expert_parallel: bool = False
    # QUANTIZATION_METHODS: "fp8" and "w8a8" quantize a bf16/fp16/fp32 checkpoint as it loads;
    # the others name a quantized checkpoint's format (which is read without the flag too).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": e4m3 with per-layer scales
    runner: str = "auto"  # RUNNERS: generate, embed ("pooling"), or as the checkpoint says
    # JSON, as the peers spell it (engine_core/speculative.py SpeculativeConfig); None: off
    speculative_config: str | None = None
    # LoRA (engine_core/lora/): adapters named by requests, at most max_loras in device slots at
    # once and max_cpu_loras (None: max_loras) in host memory, of rank up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    # A vision-language model's encoder cache: image embeddings kept by image hash, least
    # recently used evicted past this many GiB (engine_core/multimodal.py).
    encoder_cache_memory_gb: float = 0.5
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES

    def speculation(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config, or None."""
        from engine_core.speculative import SpeculativeConfig

        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization {self.quantization!r} is not supported; choose one of "
                f"{', '.join(QUANTIZATION_METHODS)} (or leave it out)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; choose one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy {self.scheduling_policy!r} is not supported; choose one "
                f"of {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.runner not in RUNNERS:
            raise ValueError(
                f"--runner {self.runner!r} is not supported; choose one of {', '.join(RUNNERS)}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN too
            raise ValueError(
                f"--gpu-memory-utilization is a share of the GPU's memory in (0, 1], got "
                f"{self.gpu_memory_utilization}"
            )
        if not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(
                "--kv-cache-memory-gb must be a number of GiB above 0, got "
                f"{self.kv_cache_memory_gb}"
            )
        if self.speculative_config is not None:
            self.speculation()  # ValueError naming what is wrong
            method = self.speculation().method
            if self.tensor_parallel_size != 1 and method != "ngram":
                raise ValueError(
                    f"--speculative-config method {method!r} with --tensor-parallel-size > 1 "
                    "is not supported yet (n-gram speculation is)"
                )
        self.check_pipeline_parallel()
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(
                f"--tp-all-reduce {self.tp_all_reduce!r} is not supported; choose one of "
                f"{', '.join(TP_ALL_REDUCES)}"
            )
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(MODEL_DTYPES)}")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"--device {self.device!r}: choose auto, cpu, cuda or cuda:N")
        sizes = (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "num_kv_blocks",
            "prefill_max_batch_size",
            "data_parallel_size",
        )
        for name in sizes:
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1 (or left out), got {value}")
        if self.max_prefill_graph_tokens is not None and self.max_prefill_graph_tokens < 0:
            raise ValueError(
                f"--max-prefill-graph-tokens must be 0 (no prefill graphs) or more, got "
                f"{self.max_prefill_graph_tokens}"
            )
        if self.seed is not None and not TORCH_SEED_MIN <= self.seed <= TORCH_SEED_MAX:
            raise ValueError(
                f"--seed {self.seed} is outside what a generator takes "
                f"[{TORCH_SEED_MIN}, {TORCH_SEED_MAX}]"
            )
        if not 0 <= self.encoder_cache_memory_gb < math.inf:  # NaN too
            raise ValueError(
                "--encoder-cache-memory-gb must be a number of GiB, 0 or more, got "
                f"{self.encoder_cache_memory_gb}"
            )
        budget = self.max_num_batched_tokens
        if self.max_num_seqs is not None and budget is not None and budget < self.max_num_seqs:
            # Each running sequence needs a token of the step's budget to decode: below that,
            # the last decodes of a full batch would wait for ever and nothing new is admitted.
            raise ValueError(
                f"--max-num-batched-tokens ({budget}) must be at least "
                f"--max-num-seqs ({self.max_num_seqs}): every running sequence takes a token of "
                "each step's budget"
            )
        if self.profile_dir is not None:
            check_profile_dir(self.profile_dir)
        self.check_lora()
        self.check_nodes()
        self.check_kv_offload()
        self.check_state_snapshots()
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "--enable-expert-parallel shards the experts over the tensor-parallel ranks: it "
                "needs --tensor-parallel-size > 1"
            )

    @property
    def world_size(self) -> int:
        """The engine core's processes: a tensor-parallel group for each pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_pipeline_parallel(self) -> None:
        """What pipeline stages do not compose with yet is refused, by name."""
        pp = self.pipeline_parallel_size
        if pp < 1 or self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} and "
                f"--pipeline-parallel-size {pp} must both be at least 1"
            )
        if pp == 1:
            return
        refused = {
            "--speculative-config": self.speculative_config is not None,
            "--enable-lora": self.enable_lora,
            "--enable-expert-parallel": self.enable_expert_parallel,
        }
        given = [flag for flag, on in refused.items() if on]
        if given:
            raise ValueError(
                f"{', '.join(given)} with --pipeline-parallel-size > 1 is not supported yet "
                '(docs/design/multi-node.md, "Pipeline parallelism")'
            )

    def check_nodes(self) -> None:
        """The multi-node flags fit together (engine_core/nodes.py reads the secret file)."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} must be in [0, --nnodes) and --nnodes "
                f"{self.nnodes} at least 1"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port")
        if not 0 < self.dist_timeout < math.inf:
            raise ValueError(f"--dist-timeout {self.dist_timeout} must be positive (seconds)")
        if self.nnodes == 1:
            given = [f for f in ("master_addr", "dist_secret_file") if getattr(self, f)]
            if given:
                flags = ", ".join("--" + f.replace("_", "-") for f in given)
                raise ValueError(f"{flags}: for an engine over several nodes (--nnodes > 1)")
            return
        self._check_node_layout()
        if not self.master_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address)")
        if self.dist_secret_file is None and not is_loopback_host(self.master_addr):
            raise ValueError(
                f"--master-addr {self.master_addr} is not a loopback address: the nodes' "
                "rendezvous and tensors would cross a network, which torch.distributed does "
                "not authenticate; give every node the same --dist-secret-file (and keep the "
                "network private: docs/security.md)"
            )

    def _check_node_layout(self) -> None:
        if self.world_size % self.nnodes:
            ranks = f"--tensor-parallel-size {self.tensor_parallel_size}"
            if self.pipeline_parallel_size > 1:
                ranks += f" x --pipeline-parallel-size {self.pipeline_parallel_size}"
            raise ValueError(
                f"{ranks} must be a multiple of --nnodes {self.nnodes}: each node runs "
                "tensor_parallel_size x pipeline_parallel_size / nnodes ranks"
            )
        if self.data_parallel_size != 1:
            raise ValueError(
                "--data-parallel-size > 1 with --nnodes > 1 is not supported: one engine core "
                "spans the nodes"
            )

    def overlaps(self, on_cpu: bool) -> bool:
        """Whether the loop overlaps: as --async-scheduling says, else on with a GPU or with
        pipeline stages (the field's comment); ``on_cpu``: the engine's device is the CPU."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return not on_cpu or self.pipeline_parallel_size > 1

    def num_drafted_positions(self) -> int:
        """K, the drafts a verify step may score per request (0 without speculation)."""
        spec = self.speculation()
        return 0 if spec is None else spec.num_speculative_tokens

    def with_max_num_seqs(self, large_gpu: bool) -> EngineConfig:
        """This config with --max-num-seqs resolved where it was left unset:
        LARGE_GPU_MAX_NUM_SEQS where ``large_gpu`` (the runner decides: engine_core/model_runner.py
        ``resolve_max_num_seqs``), else DEFAULT_MAX_NUM_SEQS, never past the step's token budget
        (every running sequence takes a token of each step)."""
        if self.max_num_seqs is not None:
            return self
        seqs = LARGE_GPU_MAX_NUM_SEQS if large_gpu else DEFAULT_MAX_NUM_SEQS
        return dataclasses.replace(self, max_num_seqs=min(seqs, self.token_budget))

    @property
    def token_budget(self) -> int:
        """A step's token budget: --max-num-batched-tokens, resolved where it was left unset
        (``with_token_budget``; DEFAULT_MAX_NUM_BATCHED_TOKENS before that)."""
        budget = self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS if budget is None else budget

    def with_token_budget(self, on_cpu: bool) -> EngineConfig:
        """This config with --max-num-batched-tokens resolved where it was left unset:
        CPU_MAX_NUM_BATCHED_TOKENS on the CPU (at least --max-num-seqs), else
        DEFAULT_MAX_NUM_BATCHED_TOKENS."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if on_cpu:
            budget = max(CPU_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs or 0)
        return dataclasses.replace(self, max_num_batched_tokens=budget)

    def num_state_snapshots(self) -> int:
        """Saved linear-attention states a model with such layers keeps (0 without caching)."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.state_snapshots is None else self.state_snapshots

    def check_state_snapshots(self) -> None:
        if self.state_snapshots is None:
            return
        if self.state_snapshots < 0:
            raise ValueError(f"--state-snapshots {self.state_snapshots} must be 0 (off) or more")
        if self.state_snapshots and not self.enable_prefix_caching:
            raise ValueError(
                f"--state-snapshots {self.state_snapshots} keeps states for prefix-cache hits: "
                "it needs prefix caching (drop --no-enable-prefix-caching)"
            )

    def check_kv_offload(self) -> None:
        """--kv-offload-gb fits the other flags (the runner refuses the models it cannot keep)."""
        if not 0 <= self.kv_offload_gb < math.inf:  # NaN too
            raise ValueError(
                "--kv-offload-gb must be a number of GiB, 0 (off) or more, got "
                f"{self.kv_offload_gb}"
            )
        if not self.kv_offload_gb:
            return
        if not self.enable_prefix_caching:
            raise ValueError(
                "--kv-offload-gb keeps evicted prefix-cache blocks: it needs prefix caching "
                "(drop --no-enable-prefix-caching)"
            )

    def check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras}): every adapter in a slot is also kept in host memory"
            )
        if self.enable_lora and self.enable_expert_parallel:
            # Each rank would hold whole experts and only their adapters' slots; not built yet.
            raise ValueError("--enable-lora with --enable-expert-parallel is not supported yet")

    @property
    def lora_host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @property
    def policy(self) -> SchedulingPolicy:
        """The parsed --scheduling-policy."""
        return SchedulingPolicy[self.scheduling_policy.upper()]

    @property
    def max_prefills_per_step(self) -> int:
        return self.prefill_max_batch_size or self.max_num_seqs
