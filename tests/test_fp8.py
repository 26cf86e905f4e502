"""FP8 weights on the CPU: each checkpoint format, written here in its own layout, loads through
our loader and gives HF transformers' greedy tokens for what the checkpoint means.

The CPU runs FP8 layers through the reference (engine_core/models/fp8.py): weights dequantized,
activations quantized to e4m3 and back as the scheme says (per token, per token and column
group, or with the static scale), as the GPU kernels quantize them. The references:

- compressed-tensors checkpoints: HF running the checkpoint itself (transformers applies
  compressed-tensors' activation quantization on the CPU);
- transformers' "fp8" format, which transformers dequantizes on the CPU and runs without
  activation quantization: HF on a plain checkpoint of the dequantized values, computed here
  independently of our code (e4m3 values times their row's or block's scale), with the scheme's
  activation round trip added by forward pre-hooks (tests/quant_fixtures.py quantize_inputs).

Same tokens, logits within ATOL (float32, the two implementations' own rounding). Bad
checkpoints each give their own clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_core.config import EngineConfig, Fp8Config
from engine_core.loader import load_model
from engine_core.models.fp8 import check_fp8_block_on_device, check_fp8_device
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    GreedyResult,
    assert_matches,
    generate_greedy,
    hf_greedy,
    random_prompts,
    randomize,
)
from tests.quant_fixtures import (
    LINEARS,
    assert_matches_quantized,
    e4m3_per_token,
    e4m3_static,
    quantize_inputs,
    sliced,
    write_compressed_tensors,
)
from tests.quant_fixtures import make_hf_model as make_llama

VOCAB = 256
NEW_TOKENS = 16
ATOL = 1e-4
PROMPTS = random_prompts(VOCAB, (5, 11, 23))
E4M3 = torch.float8_e4m3fn
BLOCK = (32, 32)  # divides every projection of the tiny model (64 and 128 wide, 32-wide k/v)
STATIC_SCALE = 0.05


# ---- the formats, written as their tools write them ---------------------------------------------


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
    return (w / scale).to(E4M3), scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().reshape(1) / 448.0
    return (w / scale).to(E4M3), scale


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """A scale per block (32 x 32 unless told); a last partial block of rows or columns
    (DeepSeek-V3's 576-row kv_a_proj in 128-row blocks) has its own scale, as the published
    checkpoints do."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block[1], 0, -rows % block[0]))
    tiles = padded.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [ceil(N / rows), ceil(K / cols)]
    quantized = (tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return quantized.to(E4M3), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """Independent of our code: a [N, 1] / [1] scale broadcasts; a block scale tiles."""
    if scale.dim() == 2 and tuple(scale.shape) != (q.shape[0], 1):
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        scale = scale[: q.shape[0], : q.shape[1]]
    return q.float() * scale


def compressed_tensors_config(preset: str, kv_scales: bool = False) -> dict:
    """quantization_config as llm-compressor writes it, from compressed-tensors' own presets."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        preset_name_to_scheme,
    )

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.block_structure:
        scheme.weights.block_structure = list(BLOCK)
        scheme.input_activations.group_size = BLOCK[1]
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor") if kv_scales else None
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=["lm_head"],
        format="float-quantized",
        kv_cache_scheme=kv,
        quantization_status="compressed",
    )
    return config.model_dump(mode="json")


@dataclasses.dataclass
class Format:
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    config: Callable[[], dict]
    scale_name: str = "weight_scale"
    static_input: bool = False
    # The activations' round trip, for a reference HF runs on the dequantized weights; None:
    # HF runs the checkpoint itself.
    activations: Callable[[torch.Tensor], torch.Tensor] | None = None
    block: tuple[int, int] = BLOCK  # of a block-wise format


def fp8_block_format(block: tuple[int, int] = BLOCK, not_converted: tuple[str, ...] = ()) -> Format:
    """transformers' block-FP8 format (DeepSeek-V3's, Qwen3-FP8's) with blocks of ``block``;
    modules whose names contain a ``not_converted`` entry stay in float."""
    return Format(
        functools.partial(quantize_blocks, block=block),
        lambda: {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": list(not_converted),
        },
        scale_name="weight_scale_inv",
        activations=lambda x: e4m3_per_token(x, block[1]),
        block=block,
    )


FORMATS = {
    "ct-channel-dynamic": Format(
        quantize_per_row, lambda: compressed_tensors_config("FP8_DYNAMIC")
    ),
    "ct-tensor-static": Format(
        quantize_per_tensor, lambda: compressed_tensors_config("FP8"), static_input=True
    ),
    "ct-block": Format(quantize_blocks, lambda: compressed_tensors_config("FP8_BLOCK")),
    "fp8-block": fp8_block_format(),
    "fp8-tensor-static": Format(
        quantize_per_tensor,
        lambda: {"quant_method": "fp8", "activation_scheme": "static"},
        static_input=True,
        activations=e4m3_static(STATIC_SCALE),
    ),
}


def make_hf_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**tiny_hf_sizes(VOCAB))).eval()
    randomize(model, seed)
    return model


def write_quantized(
    hf_model: torch.nn.Module,
    fmt: Format,
    quantized_dir: Path,
    reference_dir: Path,
    linears: tuple[str, ...] = LINEARS,
) -> None:
    """``quantized_dir``: the FP8 checkpoint (every linear whose leaf name is in ``linears``
    quantized); ``reference_dir``: a plain float32 checkpoint of the values it stands for (what
    HF runs as the reference)."""
    hf_model.save_pretrained(reference_dir)
    state = load_file(reference_dir / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, param = name.rpartition(".")
        if param != "weight" or module.rpartition(".")[2] not in linears:
            quantized[name] = tensor
            continue
        q, scale = fmt.quantize(tensor)
        quantized[name], quantized[f"{module}.{fmt.scale_name}"] = q, scale
        state[name] = dequantize(q, scale, fmt.block)
        if fmt.static_input:
            quantized[f"{module}.input_scale"] = torch.tensor([STATIC_SCALE])
    save_file(state, str(reference_dir / "model.safetensors"))
    write_folder(quantized_dir, reference_dir, quantized, fmt.config())


def write_folder(
    folder: Path, like: Path, tensors: dict[str, torch.Tensor], quantization_config: dict
) -> None:
    folder.mkdir(exist_ok=True)
    config = json.loads((like / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def reference_run(
    folder: Path, activations: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[GreedyResult]:
    """HF's greedy run of ``folder``; with ``activations``, every decoder linear's input goes
    through it first."""
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if activations is not None:
        quantize_inputs(hf_model, activations)
    return [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def format_reference(fmt: Format, tmp_path: Path) -> list[GreedyResult]:
    """HF on the checkpoint (compressed-tensors), else on its dequantized weights with the
    activations' round trip."""
    if fmt.activations is None:
        return reference_run(tmp_path / "fp8")
    return reference_run(tmp_path / "ref", fmt.activations)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model()


# ---- each format matches HF on what the checkpoint means -----------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_fp8_checkpoint_matches_hf(name: str, hf_model: torch.nn.Module, tmp_path: Path) -> None:
    write_quantized(hf_model, FORMATS[name], tmp_path / "fp8", tmp_path / "ref")
    ours = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == E4M3 and qkv.fp8 is not None  # held in FP8, not widened
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches(got, format_reference(FORMATS[name], tmp_path), ATOL)


def test_llm_compressors_fp8_dynamic_matches_hf(tmp_path: Path) -> None:
    """FP8_DYNAMIC as llm-compressor writes it (by the compressed-tensors package itself,
    tests/quant_fixtures.py): HF runs the checkpoint."""
    plain = tmp_path / "plain"
    make_llama(seed=2).save_pretrained(plain)
    folder = write_compressed_tensors(plain, tmp_path / "fp8", "FP8_DYNAMIC")
    ours = load_model(str(folder), torch.device("cpu"), torch.float32).module
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS, prefill_chunk=5, stagger=2)
    assert_matches_quantized(got, reference_run(folder))


def test_activations_are_quantized_on_the_cpu(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """The FP8-dynamic checkpoint's own forward is not its dequantized weights' (issue 66: 21 of
    32 tokens agreed): the CPU must quantize the activations to differ from the latter."""
    write_quantized(hf_model, FORMATS["ct-channel-dynamic"], tmp_path / "fp8", tmp_path / "ref")
    ours = load_model(str(tmp_path / "fp8"), torch.device("cpu"), torch.float32).module
    got = generate_greedy(ours, PROMPTS[:1], 4).logits[0]
    weights_only = reference_run(tmp_path / "ref")[0].logits[0][:4]
    assert (got - weights_only).abs().max() > 100 * ATOL


def test_quantization_flag_quantizes_per_row_as_it_loads(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    """--quantization fp8 on a plain checkpoint: e4m3 weights with one absmax scale per output
    row, the same values as the test's own per-row quantization."""
    plain, ref = tmp_path / "plain", tmp_path / "ref"
    hf_model.save_pretrained(plain)
    write_quantized(hf_model, FORMATS["ct-channel-dynamic"], tmp_path / "unused", ref)
    ours = load_model(str(plain), torch.device("cpu"), torch.float32, quantization="fp8").module
    assert ours.model.layers[1].mlp.down_proj.weight.dtype == E4M3
    got = generate_greedy(ours, PROMPTS, NEW_TOKENS)
    assert_matches(got, reference_run(ref, e4m3_per_token), ATOL)


def test_fp8_changes_the_logits_at_all(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """The comparisons above only prove the format is read if ignoring the scales would fail."""
    hf_model.save_pretrained(tmp_path)
    plain = load_model(str(tmp_path), torch.device("cpu"), torch.float32).module
    fp8 = load_model(str(tmp_path), torch.device("cpu"), torch.float32, quantization="fp8").module
    a = generate_greedy(plain, PROMPTS[:1], 4).logits[0]
    b = generate_greedy(fp8, PROMPTS[:1], 4).logits[0]
    assert (a - b).abs().max() > 100 * ATOL


# ---- bad checkpoints and flags ------------------------------------------------------------------


def fp8_folder(hf_model: torch.nn.Module, tmp_path: Path, name: str = "ct-channel-dynamic") -> Path:
    write_quantized(hf_model, FORMATS[name], tmp_path / "fp8", tmp_path / "ref")
    return tmp_path / "fp8"


def edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def load(folder: Path, **kwargs: str) -> None:
    load_model(str(folder), torch.device("cpu"), torch.float32, **kwargs)


SCALE = "model.layers.0.self_attn.k_proj.weight_scale"


def test_missing_scale_is_named(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    edit_tensors(folder, lambda t: t.pop(SCALE))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*qkv_proj\.weight_scale\[1\]"):
        load(folder)


def test_scale_of_wrong_shape_is_named(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    edit_tensors(folder, lambda t: t.update({SCALE: torch.ones(7, 1)}))
    with pytest.raises(ValueError, match=f"{SCALE}.*shape \\(7,\\), expected \\(32,\\)"):
        load(folder)


def test_non_positive_scale_is_refused(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    edit_tensors(folder, lambda t: t[SCALE].zero_())
    with pytest.raises(ValueError, match=f"{SCALE}.*not positive"):
        load(folder)


def test_fp8_weights_without_a_quantization_config(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    edit_config(folder, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="declares no quantization_config for it"):
        load(folder)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "hqq", "bits": 4}, "quant_method 'hqq' is not a format Tandem reads"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "needs two sizes and dynamic activations",
        ),
    ],
)
def test_unreadable_formats_are_named(
    quantization_config: dict, message: str, hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    edit_config(folder, lambda c: c.update(quantization_config=quantization_config))
    with pytest.raises(ValueError, match=message):
        load(folder)


def test_fp8_weights_under_an_int8_config_are_refused(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    config = compressed_tensors_config("W8A8") | {"format": "int-quantized"}
    edit_config(folder, lambda c: c.update(quantization_config=config))
    with pytest.raises(ValueError, match=r"is torch.float8_e4m3fn, but .* makes this layer torch"):
        load(folder)


def test_weight_only_fp8_is_refused(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    folder = fp8_folder(hf_model, tmp_path)
    config = compressed_tensors_config("FP8_DYNAMIC")
    config["config_groups"]["group_0"]["input_activations"] = None
    edit_config(folder, lambda c: c.update(quantization_config=config))
    with pytest.raises(ValueError, match="weight-only FP8"):
        load(folder)


def test_unknown_quantization_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="--quantization 'int4' is not supported"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16' is not supported"):
        EngineConfig(kv_cache_dtype="fp16")


def test_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (sm_80) has no FP8 tensor cores: refused at start-up, naming the GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="NVIDIA A100 has 8.0"):
        check_fp8_device(torch.device("cuda"), "--quantization fp8")


@pytest.mark.parametrize("block", [(32, 32), (128, 32), (96, 128)])
def test_blocks_the_gpu_gemm_cannot_take_are_refused_on_cuda(block: tuple[int, int]) -> None:
    """The CUDA block GEMM takes 64k x 64 or 128 blocks: anything else is refused at load
    (the CPU reference takes any block, so CI's tiny checkpoints keep 32 x 32)."""
    config = Fp8Config("block", block=block, source="test checkpoint")
    check_fp8_block_on_device(config, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"{block[0]} x {block[1]} blocks"):
        check_fp8_block_on_device(config, torch.device("cuda"))
    for fine in ((128, 128), (64, 64), (128, 64)):
        check_fp8_block_on_device(Fp8Config("block", block=fine), torch.device("cuda"))


# ---- tensor parallelism and the engine ----------------------------------------------------------


def generate_tokens(folder: Path, **engine_args: object) -> list[list[int]]:
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams

    llm = LLM(str(folder), block_size=4, num_kv_blocks=64, max_model_len=128, **engine_args)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(PROMPTS, params, detokenize=False)]
    finally:
        llm.engine.shutdown()


def test_tp2_fp8_with_a_static_scale_matches_tp1(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """Each rank holds its rows (or columns) of the FP8 weights and their scales: per-tensor
    scales and static input scales stay whole, so two ranks compute TP=1's values."""
    write_quantized(hf_model, FORMATS["ct-tensor-static"], tmp_path / "fp8", tmp_path / "ref")
    tp1 = generate_tokens(tmp_path / "fp8")
    tp2 = generate_tokens(tmp_path / "fp8", tensor_parallel_size=2)
    assert tp2 == tp1


def test_tp2_fp8_quantizes_each_ranks_share_per_token(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    """--quantization fp8 at TP=2: per-row scales split with the rows; a row-parallel layer's
    rank quantizes its half of each token's input with that half's own scale (as the GPU
    kernels do), which the reference's hooks do for o_proj and down_proj."""
    hf_model.save_pretrained(tmp_path / "plain")
    write_quantized(hf_model, FORMATS["ct-channel-dynamic"], tmp_path / "unused", tmp_path / "ref")
    tp2 = generate_tokens(tmp_path / "plain", tensor_parallel_size=2, quantization="fp8")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    quantize_inputs(hf, e4m3_per_token, sliced(e4m3_per_token, 2))
    assert tp2 == [hf_greedy(hf, prompt, NEW_TOKENS).tokens[0] for prompt in PROMPTS]


def test_kv_cache_scales_are_read_per_layer(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """compressed-tensors' kv_cache_scheme: self_attn.k_scale / v_scale per layer reach the
    loaded model's KV scales (the model runner gives them to an FP8 cache)."""
    folder = fp8_folder(hf_model, tmp_path)
    scales = {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.5 + i + (kv == "v"))
        for i in range(2)
        for kv in "kv"
    }
    edit_tensors(folder, lambda t: t.update(scales))
    config = compressed_tensors_config("FP8_DYNAMIC", kv_scales=True)
    edit_config(folder, lambda c: c.update(quantization_config=config))
    loaded = load_model(str(folder), torch.device("cpu"), torch.float32)
    assert loaded.kv_scales == {0: (0.5, 1.5), 1: (1.5, 2.5)}
    edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.v_scale"))
    with pytest.raises(ValueError, match="lacks the FP8 KV cache scales of layer 1"):
        load(folder)
