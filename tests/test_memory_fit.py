"""A model that cannot fit is refused at start-up, before any allocation, with the sizes
(engine_core/memory_plan.py; docs/design/memory-planning.md, "Refuse at start-up what cannot
fit").

The estimate is checked against the real thing: the bytes of the model once loaded, the bytes
of the KV cache the model runner allocates, and hand counts of the presets' parameters.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine_core.config import EngineConfig, ModelConfig, W4A16Config
from engine_core.loader import default_dtype, load_model
from engine_core.memory_plan import (
    CUDA_HEADROOM_BYTES,
    Budget,
    MemoryPlan,
    ModelTooLargeError,
    check_fits,
    check_pinned_host_tier,
    cpu_packing_bytes,
    expert_scratch_bytes,
    host_budget,
    lora_slot_bytes,
    min_kv_bytes,
    module_bytes,
    plan_memory,
)
from engine_core.models import build_model
from engine_core.models.layers import pack_cpu_weights
from engine_core.models.quant_config import with_quantization_flag
from engine_core.presets import PRESETS
from tests.server_fixture import free_port

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # a name only: nothing here touches a GPU
GiB = 2**30


class Stop(Exception):
    """Raised by the test's fit check to end a load before anything is allocated."""


def meta_estimate(model: str, dtype: torch.dtype) -> tuple[nn.Module, ModelConfig]:
    """The meta-device model the loader hands its fit check, without loading anything."""
    seen: list[tuple[nn.Module, ModelConfig]] = []

    def capture(module: nn.Module, config: ModelConfig) -> None:
        seen.append((module, config))
        raise Stop

    with pytest.raises(Stop):
        load_model(model, CPU, dtype, check_fit=capture)
    return seen[0]


def loaded_bytes(module: nn.Module) -> int:
    """What the loaded model holds, counted tensor by tensor (a tied weight once)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params + sum(b.numel() * b.element_size() for b in module.buffers())


def llama_params(c: ModelConfig) -> int:
    """A dense Llama's parameter count by hand: embeddings, attention, MLP, norms, LM head."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (2 * q + 2 * kv)  # q, o: hidden x q; k, v: hidden x kv
    mlp = 3 * c.hidden_size * c.intermediate_size
    per_layer = attention + mlp + 2 * c.hidden_size  # two RMSNorms
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return c.vocab_size * c.hidden_size + c.num_layers * per_layer + c.hidden_size + head


# ---- the weight estimate against the real thing -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-fit"))


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_the_weight_estimate_is_what_the_loaded_model_holds(which: str, tiny_dir: Path) -> None:
    """The estimate is the meta-device model the weights load into, so it matches the loaded
    model's parameters and buffers (within 1%; in practice to the byte)."""
    model = str(tiny_dir) if which == "tiny" else "default"
    meta, config = meta_estimate(model, torch.float32)
    estimate = module_bytes(meta)
    loaded = load_model(model, CPU, torch.float32)
    real = loaded_bytes(loaded.module)
    assert estimate == pytest.approx(real, rel=0.01)
    # And by hand: float32 parameters, plus a few hundred bytes of RoPE frequencies.
    assert estimate == pytest.approx(4 * llama_params(config), rel=0.01)
    # On the CPU the LM head also gets a oneDNN copy: vocab x hidden floats.
    expected = 4 * config.vocab_size * config.hidden_size
    assert cpu_packing_bytes(meta, CPU, torch.float32) in (0, expected)  # 0: no oneDNN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_packed_head_is_counted_only_where_the_loaded_model_packs_it(
    dtype: torch.dtype, tiny_dir: Path
) -> None:
    """The plan counts the LM head's oneDNN copy exactly when loading makes one: not for bf16 on
    a CPU without oneDNN's bf16 kernels (an EPYC without AVX-512, as the CPU machine has)."""
    meta, config = meta_estimate(str(tiny_dir), dtype)
    loaded = load_model(str(tiny_dir), CPU, dtype).module
    pack_cpu_weights(loaded)  # as finish_loading does for a CPU target
    packed = loaded.packed_logits_weight is not None
    expected = config.vocab_size * config.hidden_size * dtype.itemsize if packed else 0
    assert cpu_packing_bytes(meta, CPU, dtype) == expected


def test_the_default_model_is_135m_float32_parameters() -> None:
    """SmolLM2-135M: 134.5 M parameters (embedding tied), 4 bytes each on the CPU."""
    meta, _ = meta_estimate("default", torch.float32)
    assert module_bytes(meta) / 4 == pytest.approx(134.5e6, rel=0.01)


@pytest.mark.parametrize("name", ["llama-8b", "llama-1b", "smollm2-135m"])
def test_random_presets_are_estimated_by_their_parameter_count(name: str) -> None:
    """The benchmark presets go through the same loader hook; bf16 is 2 bytes a parameter."""
    meta, config = meta_estimate(f"random:{name}", torch.bfloat16)
    assert module_bytes(meta) == pytest.approx(2 * llama_params(config), rel=0.01)


def test_fp8_weights_count_one_byte_in_the_linears() -> None:
    """--quantization fp8: the decoder's linears are 1 byte a weight (plus a float32 scale per
    row); embeddings, LM head and norms stay bf16."""
    config = PRESETS["llama-8b"]
    fp8 = dataclasses.replace(config, quantization=with_quantization_flag(None, "fp8"))
    with torch.device("meta"), default_dtype(torch.bfloat16):
        module = build_model(fp8)
    c = config
    embed_and_head = 2 * c.vocab_size * c.hidden_size
    linears = llama_params(c) - embed_and_head - (2 * c.num_layers + 1) * c.hidden_size
    bf16_rest = llama_params(c) - linears
    assert module_bytes(module) == pytest.approx(linears + 2 * bf16_rest, rel=0.01)


# ---- the KV cache ------------------------------------------------------------------------------


def test_minimum_kv_is_one_sequence_by_hand() -> None:
    """SmolLM2-135M: 30 layers x K and V x 3 KV heads x 64 dims x 4 bytes a token; 2000 tokens
    take 125 blocks of 16 (2000 tokens exactly), 2001 take 126."""
    c = PRESETS["smollm2-135m"]
    per_token = 30 * 2 * 3 * 64 * 4
    assert min_kv_bytes(c, 3, 2000, 16, torch.float32) == 2000 * per_token
    assert min_kv_bytes(c, 3, 2001, 16, torch.float32) == 2016 * per_token
    # One rank of 3 holds one KV head; an FP8 cache is a byte an element.
    assert min_kv_bytes(c, 1, 2000, 16, torch.float8_e4m3fn) == 2000 * per_token // 3 // 4


def test_minimum_kv_is_what_the_runner_allocates_for_one_sequence(tiny_dir: Path) -> None:
    from engine_core.model_runner import ModelRunner

    max_len, block = 100, 16
    config = EngineConfig(
        model=str(tiny_dir),
        device="cpu",
        max_model_len=max_len,
        block_size=block,
        num_kv_blocks=math.ceil(max_len / block),
    )
    runner = ModelRunner(config)
    real = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert real == min_kv_bytes(runner.model_config, 2, max_len, block, torch.float32)


# ---- the check ---------------------------------------------------------------------------------


def plan_for(model: str, device: torch.device, budget: Budget, **engine: object) -> MemoryPlan:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta, model_config = meta_estimate(model, dtype)
    config = EngineConfig(model=model, device=device.type, **engine).with_max_num_seqs(
        large_gpu=False
    )
    return plan_memory(config, model_config, meta, device, dtype, dtype, budget)


def test_a_model_that_fits_passes() -> None:
    budget = Budget(int(0.85 * 80 * GiB) - GiB, "0.85 x 80 GiB - 1 GiB in use")
    plan = plan_for("random:llama-8b", GPU, budget, max_model_len=4096)
    assert plan.fits
    check_fits(plan)  # no error
    assert plan.headroom_bytes == CUDA_HEADROOM_BYTES


def test_mxfp4_experts_reserve_their_dequantize_scratch_on_cuda() -> None:
    """gpt-oss-20b's prefill dequantizes its experts into bf16 a chunk at a time: 21 experts of
    3 x 2880 x 2880 bf16 weights (49.8 MB each) fit the 1 GiB bound; the plan counts them on a
    GPU (and names them when the model does not fit), and not on the CPU, which never
    dequantizes a chunk."""
    budget = Budget(80 * GiB, "80 GiB")
    plan = plan_for("random:gpt-oss-20b", GPU, budget, max_model_len=4096)
    expert = 3 * 2880 * 2880 * 2
    assert plan.scratch_bytes == (GiB // expert) * expert == 21 * expert
    without = dataclasses.replace(plan, scratch_bytes=0)
    assert plan.needed_bytes - without.needed_bytes == plan.scratch_bytes
    small = dataclasses.replace(plan, budget=Budget(GiB, "1 GiB"))
    with pytest.raises(ModelTooLargeError, match="experts' dequantize scratch 0.97 GiB"):
        check_fits(small)
    cpu = plan_for("random:gpt-oss-20b", torch.device("cpu"), budget, max_model_len=4096)
    assert cpu.scratch_bytes == 0


def test_w4a16_experts_reserve_their_dequantize_scratch_on_cuda() -> None:
    """qwen3-30b-a3b's W4A16 prefill dequantizes its experts a chunk at a time under the same
    1 GiB bound: 113 of its 128 experts of 3 x 2048 x 768 bf16 weights (9.4 MB each); none on
    the CPU, and none for W4A16 without experts."""
    _, model_config = meta_estimate("random:qwen3-30b-a3b", torch.bfloat16)
    w4a16 = dataclasses.replace(model_config, quantization=W4A16Config("awq", 128, True))
    expert = 3 * 2048 * 768 * 2
    assert expert_scratch_bytes(w4a16, GPU, torch.bfloat16) == (GiB // expert) * expert
    assert GiB // expert == 113
    assert expert_scratch_bytes(w4a16, torch.device("cpu"), torch.bfloat16) == 0
    assert expert_scratch_bytes(model_config, GPU, torch.bfloat16) == 0  # bf16 experts
    dense = dataclasses.replace(w4a16, num_experts=0)
    assert expert_scratch_bytes(dense, GPU, torch.bfloat16) == 0


def test_mixtral_in_bf16_on_an_80_gb_gpu_is_refused_with_the_sizes() -> None:
    """46.8 B parameters in bf16 are 87.25 GiB: over any 80 GB card, whatever the KV cache."""
    budget = Budget(int(0.85 * 80 * GiB) - GiB, "0.85 x 80.00 GiB total - 1.00 GiB in use")
    plan = plan_for("random:mixtral-8x7b", GPU, budget, max_model_len=4096)
    assert not plan.fits
    with pytest.raises(ModelTooLargeError) as info:
        check_fits(plan)
    message = str(info.value)
    assert "\n" not in message
    assert "'random:mixtral-8x7b'" in message
    assert "weights 87.25 GiB" in message
    # 32 layers x 2 x 8 KV heads x 128 dims x 2 bytes x 4096 tokens = 0.5 GiB
    assert "KV cache 0.50 GiB (one sequence of 4096 tokens)" in message
    assert f"budget of {(int(0.85 * 80 * GiB) - GiB) / GiB:.2f} GiB" in message
    assert "0.85 x 80.00 GiB total - 1.00 GiB in use" in message
    for flag in ("--max-model-len", "--quantization fp8", "--tensor-parallel-size"):
        assert flag in message


def test_a_cpu_kv_cache_over_the_memory_is_refused(tiny_dir: Path) -> None:
    budget = Budget(8 * GiB, "MemAvailable in /proc/meminfo")
    plan = plan_for(str(tiny_dir), CPU, budget, kv_cache_memory_gb=10.0)
    with pytest.raises(ModelTooLargeError, match=r"KV cache 10.00 GiB \(--kv-cache-memory-gb 10\)"):
        check_fits(plan)
    check_fits(plan_for(str(tiny_dir), CPU, budget, kv_cache_memory_gb=1.0))


def test_a_cpu_host_kv_tier_shares_the_host_budget(tiny_dir: Path) -> None:
    """On the CPU --kv-offload-gb is one more pool of host memory, beside the KV cache."""
    budget = Budget(8 * GiB, "MemAvailable in /proc/meminfo")
    plan = plan_for(str(tiny_dir), CPU, budget, kv_cache_memory_gb=1.0, kv_offload_gb=7.5)
    assert plan.needed_bytes == plan.weight_bytes + plan.kv_bytes + int(7.5 * GiB)
    with pytest.raises(ModelTooLargeError) as info:
        check_fits(plan)
    assert "+ host KV tier 7.50 GiB (--kv-offload-gb)" in str(info.value)
    assert "a smaller --kv-offload-gb" in str(info.value)
    check_fits(plan_for(str(tiny_dir), CPU, budget, kv_cache_memory_gb=1.0, kv_offload_gb=6.0))


def test_a_pinned_host_kv_tier_over_the_host_memory_is_refused() -> None:
    """On CUDA the tier is pinned host memory, checked apart from the GPU's budget."""
    budget = Budget(8 * GiB, "MemAvailable in /proc/meminfo")
    with pytest.raises(ModelTooLargeError, match=r"--kv-offload-gb 9 needs 9.00 GiB of pinned"):
        check_pinned_host_tier(9.0, budget)
    check_pinned_host_tier(7.0, budget)
    check_pinned_host_tier(9.0, None)  # no /proc/meminfo: not known, not checked
    plan = plan_for("random:llama-8b", GPU, Budget(80 * GiB, "GPU"), kv_offload_gb=100.0)
    assert plan.host_kv_bytes == 0  # not part of the GPU's budget


def test_cpu_tensor_parallel_ranks_share_the_host() -> None:
    """On the CPU every rank is a process on this host: the budget covers all of them."""
    budget = Budget(10 * GiB, "MemAvailable in /proc/meminfo")
    one = plan_for("random:smollm2-135m", CPU, budget, kv_cache_memory_gb=1.0)
    three = plan_for(
        "random:smollm2-135m", CPU, budget, kv_cache_memory_gb=1.0, tensor_parallel_size=3
    )
    assert three.ranks == 3
    # Each rank sizes its own cache from --kv-cache-memory-gb (whole blocks of its KV heads).
    assert 0.99 * GiB < three.kv_bytes <= GiB and 0.99 * GiB < one.kv_bytes <= GiB
    assert three.needed_bytes == 3 * (three.weight_bytes + three.kv_bytes)


# ---- LoRA slots ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_lora_slots_are_planned_as_install_lora_allocates(family: str, tmp_path: Path) -> None:
    """The plan's LoRA bytes are what wrapping the loaded model's projections allocates, to the
    byte (a dense Llama's four projections; a Qwen3-MoE's attention and stacked experts)."""
    from engine_core.lora.adapter import target_shapes
    from engine_core.lora.layers import install_lora
    from tests.factories import write_tiny_llama, write_tiny_qwen3_moe

    folder = write_tiny_llama(tmp_path) if family == "dense" else write_tiny_qwen3_moe(tmp_path)
    loaded = load_model(str(folder), CPU, torch.float32)
    config = EngineConfig(model=str(folder), enable_lora=True, max_loras=3, max_lora_rank=8)
    planned = lora_slot_bytes(config, loaded.config, torch.float32)
    wrapped = install_lora(loaded.module, target_shapes(loaded.config), 3, 8, torch.float32, CPU)
    assert planned == sum(layer.num_bytes for layer in wrapped.values()) > 0
    off = dataclasses.replace(config, enable_lora=False)
    assert lora_slot_bytes(off, loaded.config, torch.float32) == 0


def test_lora_slots_of_a_tensor_parallel_rank_by_hand(tiny_dir: Path) -> None:
    """One of two ranks: A whole and B halved on the column-parallel projections (qkv,
    gate_up), A halved and B whole on the row-parallel ones (o, down); float32, 2 slots of
    rank 4."""
    _, c = meta_estimate(str(tiny_dir), torch.float32)
    slots, r = 2, 4
    q, kv, h, i = (
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.hidden_size,
        c.intermediate_size,
    )
    qkv = 3 * r * h + (q + 2 * kv) // 2 * 3 * r
    o = r * q // 2 + h * r
    gate_up = 2 * r * h + i * 2 * r
    down = r * i // 2 + h * r
    by_hand = c.num_layers * slots * (qkv + o + gate_up + down) * 4
    config = EngineConfig(
        model=str(tiny_dir), enable_lora=True, max_loras=slots, max_lora_rank=r,
        tensor_parallel_size=2,
    )  # fmt: skip
    assert lora_slot_bytes(config, c, torch.float32) == by_hand


def test_lora_slots_past_the_memory_are_refused_naming_the_flags(tiny_dir: Path) -> None:
    """Slots that cannot fit are refused before any allocation, with their size and the two
    flags that set it (they were allocated until the host's memory ran out)."""
    budget = Budget(8 * GiB, "MemAvailable in /proc/meminfo")
    plan = plan_for(str(tiny_dir), CPU, budget, enable_lora=True, max_loras=4, max_lora_rank=16)
    assert plan.lora_bytes > 0 and plan.needed_bytes == (
        plan.weight_bytes + plan.kv_bytes + plan.lora_bytes
    )
    check_fits(plan)
    huge = plan_for(str(tiny_dir), CPU, budget, enable_lora=True, max_loras=100_000)
    with pytest.raises(ModelTooLargeError) as info:
        check_fits(huge)
    assert f"LoRA slots {huge.lora_bytes / GiB:.2f} GiB (--max-loras x --max-lora-rank)" in str(
        info.value
    )
    assert "a smaller --max-loras or --max-lora-rank" in str(info.value)


def test_host_budget_reads_mem_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemAvailable:   1048576 kB\n")
    assert host_budget(meminfo) == Budget(GiB, f"MemAvailable in {meminfo}")
    assert host_budget(tmp_path / "absent") is None


# ---- end to end --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["engine", "serve", "generate"])
def test_a_kv_cache_larger_than_the_machine_exits_at_start_up(
    command: str, tiny_model_dir: Path
) -> None:
    """A real process: refused before allocating, one line with the sizes, no traceback."""
    extra = {"serve": ["--port", str(free_port())], "generate": ["--prompt", "hi"]}
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", command, "--model", str(tiny_model_dir),
         "--device", "cpu", "--kv-cache-memory-gb", "1000000", *extra.get(command, [])],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "does not fit on cpu" in result.stderr
    assert "KV cache 1000000.00 GiB (--kv-cache-memory-gb 1000000)" in result.stderr
    assert "MemAvailable in /proc/meminfo" in result.stderr
    assert "a smaller --kv-cache-memory-gb" in result.stderr
