"""LoRA in the engine core (engine_core/lora/): PEFT adapters written by peft on a tiny random
Llama give HF transformers + PEFT's greedy tokens, alone and in one batch with other adapters
and the base model; slots are shared out by LRU; the prefix cache keeps adapters apart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine_core.config import ModelConfig
from engine_core.llm import LLM
from engine_core.loader import load_model_config
from engine_core.lora.adapter import LoraError, load_adapter
from engine_core.lora.batch import NO_SLOT, TILE_ROWS, lora_batch, tile_capacity
from engine_core.lora.layers import add_lora
from protocol.messages import FinishReason, LoraRef, SamplingParams
from tests.factories import write_tiny_llama
from tests.lora_fixtures import peft_greedy, write_adapter, write_moe_case

NEW_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [200, 31, 77]]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama and three adapters of different shapes: every projection at rank 4; q/v
    only at rank 8 with rsLoRA; every projection with a rank_pattern and an alpha_pattern."""
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_llama(root / "base")
    return {
        "base": base,
        "all": write_adapter(base, root / "all", seed=1),
        "qv": write_adapter(
            base, root / "qv", seed=2, r=8, lora_alpha=4, use_rslora=True,
            target_modules=["q_proj", "v_proj"],
        ),
        "pattern": write_adapter(
            base, root / "pattern", seed=3, r=2, lora_alpha=16,
            rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def expected(case: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """HF + PEFT's greedy tokens for each prompt, per adapter (None: the base model)."""
    names: list[str | None] = [None, "all", "qv", "pattern"]
    return {
        name: [
            peft_greedy(case["base"], None if name is None else case[name], p, NEW_TOKENS)
            for p in PROMPTS
        ]
        for name in names
    }


def ref(case: dict[str, Path], name: str) -> LoraRef:
    return LoraRef(name, str(case[name]))


def make_llm(case: dict[str, Path], **kwargs: object) -> LLM:
    fields = dict(
        block_size=4, num_kv_blocks=128, max_model_len=128, max_num_seqs=8,
        max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    return LLM(str(case["base"]), **{**fields, **kwargs})


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_adapters_differ_from_the_base_model(expected: dict) -> None:
    """The reference is not vacuous: every adapter changes some prompt's tokens."""
    for name in ("all", "qv", "pattern"):
        assert expected[name] != expected[None], name


def test_each_adapter_alone_gives_peft_tokens(case: dict[str, Path], expected: dict) -> None:
    llm = make_llm(case)
    try:
        for name in ("all", "qv", "pattern"):
            out = llm.generate(PROMPTS, GREEDY, detokenize=False, lora=ref(case, name))
            assert [o.token_ids for o in out] == expected[name], name
        base = llm.generate(PROMPTS, GREEDY, detokenize=False)
        assert [o.token_ids for o in base] == expected[None]
    finally:
        llm.engine.shutdown()


def test_a_batch_mixing_three_adapters_and_the_base(case: dict[str, Path], expected: dict) -> None:
    """Twelve requests in one batch, three adapters and the base model on every prompt, with
    three slots (each adapter resident): each gets the tokens it gets alone. With two slots the
    third adapter's requests wait for a slot and still get theirs; with one slot and room for
    one adapter in host memory, adapters read and then evicted before their turn are read
    again."""
    names: list[str | None] = ["all", None, "qv", "pattern"]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    for slots, host in ((3, 3), (2, 3), (1, 1)):
        llm = make_llm(case, max_loras=slots, max_cpu_loras=host)
        try:
            out = llm.generate(
                [PROMPTS[i] for _, i in jobs],
                GREEDY,
                detokenize=False,
                lora=[None if name is None else ref(case, name) for name, _ in jobs],
            )
            got = [o.token_ids for o in out]
            assert got == [expected[name][i] for name, i in jobs], f"{slots} slots"
            assert llm.engine.runner.loras is not None
            loads = llm.engine.runner.loras.loads
            assert loads == 3 if slots == 3 else loads >= 3
        finally:
            llm.engine.shutdown()


def test_prefix_cache_keeps_adapters_and_the_base_apart(
    case: dict[str, Path], expected: dict
) -> None:
    """The same prompt under the base model, then two adapters, then the first again: each
    adapter's run takes no block of the other's (or the base's), and the repeat hits its own."""
    prompt = PROMPTS[1]  # 11 tokens: two full blocks of 4 to share
    llm = make_llm(case)
    try:
        counts = llm.engine.scheduler.counts
        seen: set[str | None] = set()
        for name in (None, "all", "qv", "all", None):
            before = counts().prefix_cache_hits
            lora = None if name is None else ref(case, name)
            out = llm.generate([prompt], GREEDY, detokenize=False, lora=lora)
            assert out[0].token_ids == expected[name][1], name
            hits = counts().prefix_cache_hits - before
            assert hits == (8 if name in seen else 0), (name, hits)
            seen.add(name)
    finally:
        llm.engine.shutdown()


def test_a_bad_adapter_fails_its_request_and_others_go_on(
    case: dict[str, Path], expected: dict, tmp_path: Path
) -> None:
    """An adapter folder that is missing fails its request with the reason; the base model's
    request in the same call finishes as usual."""
    llm = make_llm(case)
    try:
        out = llm.generate(
            [PROMPTS[0], PROMPTS[0]],
            GREEDY,
            detokenize=False,
            lora=[LoraRef("gone", str(tmp_path / "gone")), None],
        )
        assert out[0].finish_reason == FinishReason.ERROR
        assert "no such adapter folder" in (out[0].error or "")
        assert out[1].token_ids == expected[None][0]
    finally:
        llm.engine.shutdown()


def test_an_engine_without_lora_refuses_an_adapter(case: dict[str, Path]) -> None:
    llm = make_llm(case, enable_lora=False)
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.generate([PROMPTS[0]], GREEDY, lora=ref(case, "all"))
    finally:
        llm.engine.shutdown()


# ---- the loader's refusals ---------------------------------------------------------------------


def tiny_config(case: dict[str, Path]) -> ModelConfig:
    return load_model_config(case["base"])


def edited_adapter(source: Path, out: Path, **fields: object) -> Path:
    """A copy of the adapter ``source`` whose config has ``fields`` set."""
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    config = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return out


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_bias": True}, "lora_bias"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"init_lora_weights": "pissa"}, "pissa"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"some_future_field": 1}, "some_future_field"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"target_modules": ["q_proj", "fc1"]}, "fc1"),
        ({"r": 5}, "r = 5"),
    ],
)
def test_refused_config_fields_are_named(
    case: dict[str, Path], tmp_path: Path, fields: dict, message: str
) -> None:
    adapter = edited_adapter(case["all"], tmp_path / "edited", **fields)
    with pytest.raises(LoraError, match=message):
        load_adapter(adapter, tiny_config(case), max_rank=16)


def test_an_older_pefts_fields_left_off_are_read_past(
    case: dict[str, Path], tmp_path: Path
) -> None:
    """Fields older peft versions wrote, null or false (as peft itself, and vLLM, read past
    them): the adapter loads as the same adapter; the same names set on are refused."""
    old = {"enable_lora": None, "merge_weights": False}
    edited = edited_adapter(case["qv"], tmp_path / "old", **old)
    adapter = load_adapter(edited, tiny_config(case), 8)
    plain = load_adapter(case["qv"], tiny_config(case), 8)
    assert adapter.weights.keys() == plain.weights.keys()
    for key, parts in plain.weights.items():
        for mine, theirs in zip(adapter.weights[key], parts, strict=True):
            assert mine.shard == theirs.shard
            assert torch.equal(mine.a, theirs.a) and torch.equal(mine.b, theirs.b)
    with pytest.raises(LoraError, match="merge_weights"):
        on = {"merge_weights": True}
        load_adapter(edited_adapter(case["qv"], tmp_path / "on", **on), tiny_config(case), 8)


def test_a_rank_over_the_maximum_is_refused(case: dict[str, Path]) -> None:
    with pytest.raises(LoraError, match="rank 8, over --max-lora-rank 4"):
        load_adapter(case["qv"], tiny_config(case), max_rank=4)


def test_missing_files_are_named(case: dict[str, Path], tmp_path: Path) -> None:
    config = tiny_config(case)
    with pytest.raises(LoraError, match="no such adapter folder"):
        load_adapter(tmp_path / "nothing", config, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load_adapter(tmp_path / "empty", config, 16)
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_bytes((case["all"] / "adapter_config.json").read_bytes())
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        load_adapter(half, config, 16)


def test_a_target_the_model_lacks_is_refused(case: dict[str, Path], tmp_path: Path) -> None:
    """An adapter made for a deeper model (layer 2 of a 2-layer one), and one whose tensors
    target the LM head."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(case["all"] / "adapter_model.safetensors")
    for name, extra in (
        ("deeper", "base_model.model.model.layers.2.self_attn.q_proj"),
        ("head", "base_model.model.lm_head"),
    ):
        out = edited_adapter(case["all"], tmp_path / name)
        grown = dict(tensors)
        grown[f"{extra}.lora_A.weight"] = torch.zeros(4, 64)
        grown[f"{extra}.lora_B.weight"] = torch.zeros(64, 4)
        save_file(grown, out / "adapter_model.safetensors")
        with pytest.raises(LoraError, match=extra.removeprefix("base_model.model.")):
            load_adapter(out, tiny_config(case), 16)


def test_the_adapter_is_laid_out_with_peft_scales(case: dict[str, Path]) -> None:
    """q/v-only rsLoRA at rank 8, alpha 4: B scaled by 4 / sqrt(8), q in shard 0, v in 2."""
    from safetensors.torch import load_file

    adapter = load_adapter(case["qv"], tiny_config(case), 8)
    assert set(adapter.weights) == {(0, "self_attn.qkv_proj"), (1, "self_attn.qkv_proj")}
    parts = {p.shard: p for p in adapter.weights[1, "self_attn.qkv_proj"]}
    assert set(parts) == {0, 2}
    raw = load_file(case["qv"] / "adapter_model.safetensors")
    b = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    torch.testing.assert_close(parts[2].b, b * (4 / 8**0.5))


# ---- the batched product against a row-by-row computation -------------------------------------


def test_the_grouped_product_matches_each_row_alone() -> None:
    """Rows of three slots and of none, interleaved: each row gets x @ A[s].T @ B[s].T."""
    torch.manual_seed(0)
    slots, rank, inp, out = 3, 5, 7, 9
    a, b = torch.randn(slots, rank, inp), torch.randn(slots, out, rank)
    row_slots = [(2, 1), (1, NO_SLOT), (3, 0), (1, 2), (2, 1)]
    batch = lora_batch(row_slots, torch.device("cpu"))
    assert batch is not None
    x = torch.randn(9, inp)
    base = torch.randn(9, out)
    got = add_lora(base.clone(), x, a, b, batch)
    per_row = [slot for rows, slot in row_slots for _ in range(rows)]
    for row, slot in enumerate(per_row):
        want = base[row] if slot == NO_SLOT else base[row] + b[slot] @ (a[slot] @ x[row])
        torch.testing.assert_close(got[row], want)
    assert lora_batch([(4, NO_SLOT)], torch.device("cpu")) is None


def test_the_graphs_static_lora_table_follows_each_step(case: dict[str, Path]) -> None:
    """What a CUDA graph reads of a step's LoRA rows (engine_core/cuda_graph.py), here on the
    CPU's tensors: a step's tile table, laid out for the graphs (``lora_tiles``), is copied in
    whole; a graph of fewer rows views its first tiles, which name the step's slots and rows; a
    step of the base model alone clears every tile's slot; each row's slot (the MoE experts'
    kernels') is copied in, NO_SLOT past the step's rows; a table laid out for other graphs, or
    LoRA rows for graphs without LoRA, are refused."""
    from engine_core.cuda_graph import CudaGraphRunner

    cpu = torch.device("cpu")
    llm = make_llm(case)
    try:
        runner = llm.engine.runner

        def graphs(lora_slots: int) -> CudaGraphRunner:
            return CudaGraphRunner(
                runner.model, runner.backend, max_num_seqs=8, max_model_len=64, block_size=4,
                hidden_size=runner.model_config.hidden_size, dtype=torch.float32, device=cpu,
                max_prefill_tokens=64, lora_slots=lora_slots,
            )  # fmt: skip

        on = graphs(lora_slots=2)
        assert on.lora_tiles == tile_capacity(64, 2) == 8
        step = lora_batch([(1, 1), (1, NO_SLOT), (1, 0), (1, 1)], cpu, min_tiles=on.lora_tiles)
        assert step is not None
        on._stage_lora(step, base_graph=False)
        seen = on._static_lora(4)  # what the decode graph of 4 rows captured
        assert seen is not None
        assert seen.tiles.slots.tolist() == [0, 1, NO_SLOT, NO_SLOT]
        rows = seen.tiles.rows.view(4, TILE_ROWS)[:2].tolist()
        assert rows == [[2] + [-1] * (TILE_ROWS - 1), [0, 3] + [-1] * (TILE_ROWS - 2)]
        # each row's slot, which the MoE experts' kernels read, with the graph's padding rows
        assert seen.token_slots is not None
        assert seen.token_slots.tolist() == [1, NO_SLOT, 0, 1]
        two = lora_batch([(1, 0), (1, 0)], cpu, min_tiles=on.lora_tiles)
        assert two is not None
        on._stage_lora(two, base_graph=False)  # fewer rows: the rest must not keep slot 1
        assert seen.token_slots.tolist() == [0, 0, NO_SLOT, NO_SLOT]
        on._stage_lora(step, base_graph=False)
        on._stage_lora(None, base_graph=True)  # a base-only graph reads no table: left as is
        assert seen.tiles.slots.tolist() == [0, 1, NO_SLOT, NO_SLOT]
        on._stage_lora(None, base_graph=False)
        assert seen.tiles.slots.tolist() == [NO_SLOT] * 4
        assert seen.token_slots.tolist() == [NO_SLOT] * 4
        other = lora_batch([(1, 0)], cpu)  # laid out for no graph: 4 tiles, not 8
        with pytest.raises(RuntimeError, match="not laid out for the graphs"):
            on._stage_lora(other, base_graph=False)
        with pytest.raises(RuntimeError, match="captured without LoRA"):
            graphs(lora_slots=0)._stage_lora(step, base_graph=False)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_the_default_model_with_an_adapter_gives_peft_tokens(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2-135M (tied embeddings, 30 layers) with a rank-16 adapter on every projection:
    the engine's greedy tokens are HF + PEFT's, and not the base model's."""
    adapter = write_adapter(default_model_dir, tmp_path / "smol", seed=5, r=16, lora_alpha=32)
    prompt = [1, 504, 3458, 282, 4649, 314]
    want = peft_greedy(default_model_dir, adapter, prompt, NEW_TOKENS)
    base = peft_greedy(default_model_dir, None, prompt, NEW_TOKENS)
    assert want != base
    llm = LLM(str(default_model_dir), max_model_len=128, num_kv_blocks=64, enable_lora=True)
    try:
        out = llm.generate([prompt], GREEDY, detokenize=False, lora=LoraRef("smol", str(adapter)))
        assert out[0].token_ids == want
    finally:
        llm.engine.shutdown()


# ---- LoRA on MoE experts ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen3-MoE and two adapters of its experts (lora_fixtures.write_moe_case)."""
    return write_moe_case(tmp_path_factory.mktemp("lora-moe"))


def test_moe_expert_adapters_give_peft_tokens_mixed_in_one_batch(moe_case: dict[str, Path]) -> None:
    """Each adapter alone gives HF + PEFT's tokens, and one batch of both adapters and the base
    gives each request the same."""
    names: list[str | None] = [None, "experts", "both"]
    want = {
        name: [
            peft_greedy(moe_case["base"], None if name is None else moe_case[name], p, NEW_TOKENS)
            for p in PROMPTS
        ]
        for name in names
    }
    assert want["experts"] != want[None] and want["both"] != want[None]
    llm = LLM(
        str(moe_case["base"]), block_size=4, num_kv_blocks=128, max_model_len=128,
        max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    try:
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
        out = llm.generate(
            [PROMPTS[i] for _, i in jobs],
            GREEDY,
            detokenize=False,
            lora=[None if n is None else LoraRef(n, str(moe_case[n])) for n, _ in jobs],
        )
        assert [o.token_ids for o in out] == [want[name][i] for name, i in jobs]
    finally:
        llm.engine.shutdown()


def test_expert_targets_are_checked(moe_case: dict[str, Path], tmp_path: Path) -> None:
    """A target parameter other than the experts' is refused by name; an expert adapter on a
    dense model names the module the model lacks; a rank over the maximum is refused."""
    config = load_model_config(moe_case["base"])
    odd = edited_adapter(moe_case["experts"], tmp_path / "odd", target_parameters=["mlp.w"])
    with pytest.raises(LoraError, match="target parameter 'mlp.w'"):
        load_adapter(odd, config, 16)
    with pytest.raises(LoraError, match="rank 4, over --max-lora-rank 2"):
        load_adapter(moe_case["experts"], config, 2)
    dense = dataclasses.replace(config, num_experts=0)
    with pytest.raises(LoraError, match=r"model\.layers\.\d\.mlp\.experts"):
        load_adapter(moe_case["experts"], dense, 16)


def test_phi3_fused_targets_give_peft_tokens(tmp_path: Path) -> None:
    """Phi-3 fuses q/k/v and gate/up in HF too, so its adapters target qkv_proj and
    gate_up_proj whole: each B spans the fused rows."""
    from tests.test_models_gemma_phi import make_hf_model

    base = tmp_path / "phi3"
    make_hf_model("phi3_shortrope").save_pretrained(base)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapter = write_adapter(base, tmp_path / "adapter", seed=31, target_modules=targets)
    prompt = PROMPTS[1]
    want = peft_greedy(base, adapter, prompt, NEW_TOKENS)
    assert want != peft_greedy(base, None, prompt, NEW_TOKENS)
    llm = LLM(str(base), block_size=4, num_kv_blocks=64, enable_lora=True)  # its 48 positions
    try:
        out = llm.generate([prompt], GREEDY, detokenize=False, lora=LoraRef("a", str(adapter)))
        assert out[0].token_ids == want
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_tokens(
    case: dict[str, Path], expected: dict, method: str
) -> None:
    """Drafts are verified by the adapted model: greedy tokens stay PEFT's, per adapter, with
    drafts planned: n-gram on a prompt that repeats itself, or the base model (no adapter)
    drafting."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    if method == "draft_model":
        spec = json.dumps({"model": str(case["base"]), "num_speculative_tokens": 3})
    llm = make_llm(case, speculative_config=spec)
    try:
        for name in ("all", "qv"):
            out = llm.generate(PROMPTS, GREEDY, detokenize=False, lora=ref(case, name))
            assert [o.token_ids for o in out] == expected[name], name
        assert llm.engine.scheduler.counts().spec_drafts > 0
    finally:
        llm.engine.shutdown()


def test_the_benchmark_writes_adapters_that_load(tmp_path: Path) -> None:
    """`python -m benchmarks serving --lora N`'s random adapters (benchmarks/lora_adapters.py)
    pass the loader against their preset, every projection of every layer at the rank asked."""
    from benchmarks.lora_adapters import model_config, serve_flags, write_random_adapters

    config = model_config("smollm2-135m")
    folders = write_random_adapters(config, tmp_path, count=2, rank=4)
    assert list(folders) == ["lora0", "lora1"]
    for folder in folders.values():
        adapter = load_adapter(folder, config, max_rank=4)
        assert len(adapter.weights) == 4 * config.num_layers
        assert {p.rank for parts in adapter.weights.values() for p in parts} == {4}
    flags = serve_flags(folders, 4)
    assert flags[:5] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "4"]
    assert flags[6:] == [f"lora0={folders['lora0']}", f"lora1={folders['lora1']}"]
