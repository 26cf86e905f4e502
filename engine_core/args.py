"""Command-line flags for the engine core, shared by `tandem engine`, `serve` and `generate`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from engine_core.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    LARGE_GPU_BYTES,
    LARGE_GPU_MAX_NUM_SEQS,
    EngineConfig,
)

_HELP = {
    "model": "model: 'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder, "
    "a .gguf file, or a hub id where the network allows",
    "device": "'auto' (cuda when available), 'cpu' or 'cuda'",
    "dtype": "'auto' (bfloat16 on cuda, float32 on cpu), 'float32', 'bfloat16' or 'float16'",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit, lowered "
    "to what --num-kv-blocks holds for one sequence where given); refused at start where past "
    "the model's limit or the KV cache",
    "block_size": "tokens per KV-cache block; 32 or a multiple lets prompt attention load its "
    "tiles through TMA descriptors (Hopper and newer, a bf16/fp16 cache, heads of 128, plain "
    "causal layers: about 1.2x the kernel)",
    "num_kv_blocks": "KV-cache blocks, in place of what --kv-cache-memory-gb or "
    "--gpu-memory-utilization would size (as vLLM's --num-gpu-blocks-override); unset: sized "
    "from those flags",
    "kv_cache_memory_gb": "KV-cache size on the CPU, in GiB",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "max_num_seqs": "most sequences running at once (the decode batch cap); unset (None): "
    f"{LARGE_GPU_MAX_NUM_SEQS} on one host whose GPU has {LARGE_GPU_BYTES // 2**30} GiB or more, "
    "for a model without linear-attention layers (as vLLM), else "
    f"{DEFAULT_MAX_NUM_SEQS}, and never past --max-num-batched-tokens",
    "max_num_batched_tokens": "token budget of one engine step, longer prompts run in chunks; "
    f"unset (None): {DEFAULT_MAX_NUM_BATCHED_TOKENS}, on the CPU {CPU_MAX_NUM_BATCHED_TOKENS} "
    "(the engine is silent while a step runs: a whole 8k prompt's step there came near "
    "--engine-timeout)",
    "prefill_max_batch_size": "most new requests admitted per step (default: --max-num-seqs)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_offload_gb": "a host-memory KV tier of this many GiB (pinned on CUDA; on the CPU a "
    "second pool beside --kv-cache-memory-gb): full prefix-cache blocks evicted from the KV "
    "cache are copied there, least recently used dropped first, and a later prompt with that "
    "prefix copies them back instead of computing them again; 0 turns it off. Models whose "
    "layers are all full attention; with tensor parallelism each rank keeps its shard "
    "(docs/design/kv-offload.md)",
    "state_snapshots": "models with linear-attention layers (Qwen3-Next): how many saved "
    "states (one state slot's bytes each, out of the KV cache's memory) to keep for prefix-cache "
    "hits, least recently used dropped first; a state is saved where a prompt reaches its last "
    "block boundary (and where a long prompt's chunk ends on one, and each block of an answer, "
    "which may hold at most half of them), and a hit resumes at the longest cached prefix that "
    "ends at a saved state; unset: --max-num-seqs; 0: such models take no prefix-cache hit",
    "enforce_eager": "never use CUDA graphs",
    "max_prefill_graph_tokens": "steps with prompt tokens (whole prompts, chunks, decodes mixed "
    "in) of up to this many tokens replay a CUDA graph captured at start-up "
    "instead of launching each kernel from Python; 0 runs them eagerly; unset (None): 2048, "
    "and up to --max-num-batched-tokens where start-up measures the host slower to launch a "
    "2048-token step eagerly than the GPU would be to run a whole step's tokens (a small model)",
    "seed": "seed of the engine's generator, which samples every request that carries no "
    "seed of its own: seeded once at start (as vLLM), so such requests differ from each other "
    "and a run repeats after a restart",
    "async_scheduling": "overlap: schedule and prepare the next step while the GPU runs this one "
    "(--no-async-scheduling, or --no-overlap, keeps the simple loop; default: on with a GPU or "
    "pipeline stages, else off on the CPU, where the forward runs on the loop's thread and "
    "overlap would only send each step's tokens a step late)",
    "step_stats": "time each part of every step (host and GPU, and the GPU's idle gap) and log "
    "a summary every 10 s and whenever the engine goes idle (also TANDEM_STEP_STATS=1)",
    "nvtx": "NVTX ranges around the parts of each step, for Nsight Systems",
    "profile_dir": "enable POST /start_profile and /stop_profile (vLLM's routes): torch.profiler "
    "runs in the engine core between them and writes a Chrome trace and a table of the "
    "operations that took the most time into this directory (development only: it slows "
    "every step; with tensor parallelism, rank 0's process)",
    "tensor_parallel_size": "processes (one per GPU) that one engine core shards the model over: "
    "heads, KV heads, MLP and vocabulary split across them (gloo on the CPU, NCCL on CUDA)",
    "pipeline_parallel_size": "pipeline stages the decoder layers split into, contiguous and "
    "even (the remainder one each to the stages before the last); each stage's "
    "--tensor-parallel-size processes hold only its layers' weights and KV cache, and pass "
    "the hidden states on to the next stage; up to this many micro-batches are in flight, so "
    "every stage works at once; the engine core is tensor x pipeline processes "
    "(docs/design/multi-node.md)",
    "tp_all_reduce": "with --tensor-parallel-size > 1 on GPUs: 'auto' sums tensors of up to 4 MiB "
    "(a decode step's activations) with a one-shot all-reduce over peer-to-peer GPU memory, "
    "and fuses it into the next RMSNorm, where every GPU reaches the others' memory with "
    "native atomics (NVLink); NCCL for the rest; 'nccl' uses NCCL for all",
    "quantization": "'fp8' or 'w8a8': quantize a plain checkpoint's weights to FP8 (e4m3) or "
    "int8 as they load, one scale per output channel, activations per token at run time; "
    "'awq', 'awq_marlin', 'gptq', 'gptq_marlin', 'compressed-tensors', 'auto-round' name the "
    "checkpoint's "
    "format, which must match (quantized checkpoints are read as they are without the flag)",
    "kv_cache_dtype": "'auto' (the model's dtype) or 'fp8' (e4m3, with the checkpoint's K/V "
    "scales or 1.0): half the KV bytes of bf16",
    "runner": "'auto' (an embedding model where the checkpoint says so: a sentence-transformers "
    "Pooling module, or a bare *Model architecture; else generate), 'generate', or 'pooling' "
    "(serve /v1/embeddings: each prompt's pooled final hidden state, pooled and normalised as "
    "the checkpoint says, else last-token and normalised)",
    "speculative_config": "speculative decoding, as JSON (the peers' spelling): "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}\': requests (greedy or sampled) take the tokens that followed '
    "the last n tokens' earlier occurrence as drafts, scored in one step, each position drawn "
    'as a plain step draws it (engine_core/speculative.py); also "draft_model" and '
    '"eagle3" (an EAGLE-3 head), each with a "model" folder, and "mtp" (also "deepseek_mtp", '
    '"qwen3_next_mtp": a DeepSeek-V3, Qwen3-Next or Qwen3.5 checkpoint\'s own '
    "multi-token-prediction layer)",
    "enable_lora": "serve LoRA adapters (PEFT folders) that requests name: q/k/v/o and "
    "gate/up/down targets, mixed with each other and the base model in one batch",
    "max_loras": "LoRA adapters resident in device slots at once (a request waits for a slot)",
    "max_cpu_loras": "LoRA adapters kept in host memory, least recently used out first "
    "(default: --max-loras)",
    "max_lora_rank": "the largest LoRA rank served; each slot is sized for it",
    "encoder_cache_memory_gb": "a vision-language model's encoder cache, in GiB: image "
    "embeddings kept by image hash for the next chunk or request with the same image, least "
    "recently used evicted first",
    "scheduling_policy": "'fcfs': requests wait and run in arrival order, and preemption takes "
    "the latest admitted first; 'priority': by each request's priority (lower first, ties "
    "by arrival), and preemption takes the worst priority first (vLLM's policy); under "
    "'fcfs' a request with a priority other than 0 is refused",
    "data_parallel_size": "engine cores behind one `tandem serve`, each a full copy of the model; "
    "requests go to the one with the least outstanding work",
    "nnodes": "hosts one engine's ranks span, --tensor-parallel-size x "
    "--pipeline-parallel-size / --nnodes ranks on each; run the same command on every host, "
    "each with its --node-rank (docs/design/multi-node.md)",
    "node_rank": "this host's place: 0 runs the engine core (and, with `tandem serve`, the API) "
    "and ranks 0..k-1; node R runs only ranks R*k..R*k+k-1, no API and no engine sockets, and "
    "follows node 0's engine across its restarts; k = tensor x pipeline parallel size / nnodes",
    "master_addr": "node 0's address, where the nodes meet (a TCP store on --master-port, "
    "bound to this address only); not loopback: --dist-secret-file is required",
    "master_port": "the rendezvous port on --master-addr",
    "dist_secret_file": "a file (mode 0600, the same on every node) whose contents node 0 checks "
    "each node's proof against (HMAC) before it takes part in any step; a node with another "
    "secret is refused. Traffic stays unencrypted: keep the network private",
    "enable_expert_parallel": "MoE models: each tensor-parallel rank holds 1/N of the experts, "
    "whole, instead of 1/N of every expert's width, and sends each token to its experts' ranks "
    "with all-to-alls (attention stays tensor-parallel); no CUDA graphs with it for now "
    "(docs/design/multi-node.md)",
    "dist_timeout": "seconds node 0 waits for the other nodes to join, and a node waits for node "
    "0 (at start, and after node 0's engine dies, for its restart) before giving up; node 0 "
    "stopped for good (its tandem serve or tandem engine given SIGTERM or Ctrl-C) tells the "
    "nodes, which exit with it",
}


# Fields only some commands act on: another command parses them (to refuse a value other than
# the default, naming it) but does not list them in its --help.
ONLY_FOR = {
    "data_parallel_size": frozenset({"serve"}),  # engine cores behind one server
    "profile_dir": frozenset({"serve", "engine"}),  # the offline API has no profiler routes
}


def add_engine_args(parser: argparse.ArgumentParser, command: str = "engine") -> None:
    """One flag per EngineConfig field, named --field-name, defaulting to the dataclass default;
    ``command``: whose parser it is (serve, engine, generate), for ONLY_FOR."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        # A help text that says its own default (what an unset value means) keeps it.
        text = _HELP[f.name]
        default = " (default: unset)" if f.default is None else " (default: %(default)s)"
        if "(default:" in text or (f.default is None and "unset" in text):
            default = ""
        if command not in ONLY_FOR.get(f.name, (command,)):
            group.add_argument(
                flag, type=_parse_type(f.type), default=f.default, help=argparse.SUPPRESS
            )
            continue
        if str(f.type).startswith("bool"):
            onoff = "" if f.default is None else f" (default: {'on' if f.default else 'off'})"
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=text + onoff,
            )
        else:
            group.add_argument(
                flag, type=_parse_type(f.type), default=f.default, help=text + default
            )
    group.add_argument(
        "--no-overlap",
        dest="async_scheduling",
        action="store_false",
        help="the same as --no-async-scheduling",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _parse_type(annotation: object) -> type:
    text = str(annotation)
    for name, kind in (("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str
