"""The vLLM side of the vision, speculative and LoRA serving benchmarks, from their flags: the
folder vLLM loads (a vision preset's processor config), the command lines both servers get,
and the parsing of what the servers answer (streams, /metrics). No server runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import serving, speculative_serving, vision
from benchmarks.__main__ import parse
from benchmarks.servers import (
    SERVER_COUNTERS,
    Server,
    counter_totals,
    hit_rate,
    imports,
    peer_model_dir,
    preemptions,
)
from benchmarks.speculative_serving import SpecRow, metric_totals, spec_rates, stream_tpot
from benchmarks.vision import TtftRow, format_ratios
from engine_core.presets import hf_config
from engine_core.speculative import SpeculativeConfig

VLLM = ["--vllm-python", "python3", "--vllm-pythonpath", "/tmp/vsite"]


@pytest.fixture(scope="module")
def vl_preset_dir() -> Path:
    from engine_core.model_dir import tokenizer_dir_for_preset

    return tokenizer_dir_for_preset("qwen2.5-vl-7b")


def test_a_vision_peer_folder_resizes_images_as_ours_does(
    vl_preset_dir: Path, tmp_path: Path
) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    folder = peer_model_dir("qwen2.5-vl-7b", vl_preset_dir, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    assert config == hf_config("qwen2.5-vl-7b") | {"torch_dtype": "bfloat16"}
    processor_config = json.loads((folder / "preprocessor_config.json").read_text())
    assert processor_config["processor_class"] == "Qwen2_5_VLProcessor"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (vl_preset_dir / name).read_bytes()
    # 1,024 pixels round to 37 merged 28-pixel blocks a side: 74 x 74 patches of 14 pixels.
    image = Image.new("RGB", (1024, 1024))
    grid = AutoImageProcessor.from_pretrained(str(folder))(images=[image])["image_grid_thw"]
    assert grid.tolist() == [[1, 74, 74]]
    assert vision.image_grid(vl_preset_dir, 1024) == (1, 74, 74)


def test_vision_runs_vllm_after_tandem_on_dummy_weights(
    vl_preset_dir: Path, tmp_path: Path
) -> None:
    args = parse(["vision", "--port", "8400", *VLLM, "--vllm-args", "--max-num-seqs 64"])
    tandem, vllm = vision.build_servers(args, vl_preset_dir, tmp_path)
    assert tandem.command[4:6] == ["--model", "random:qwen2.5-vl-7b"]
    assert tandem.command[-4:] == ["--device", "cuda", "--served-model-name", "default"]
    assert vllm.command[:5] == [
        "python3", "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path / "model")
    ]  # fmt: skip
    assert vllm.command[-8:] == [
        "--served-model-name", "default", "--dtype", "bfloat16", "--load-format", "dummy",
        "--max-num-seqs", "64",
    ]  # fmt: skip
    assert vllm.env["PYTHONPATH"] == "/tmp/vsite" and vllm.port != tandem.port
    # Both are asked for the model by the one name they serve it as.
    (body,) = vision.chat_bodies(1, 28, 4, vision.load_tokenizer(vl_preset_dir), seed=0)
    assert body["model"] == "default"


def test_a_peer_without_a_module_it_needs_is_found_before_it_starts(tmp_path: Path) -> None:
    server = Server("vllm", [sys.executable, "-m", "unused"], 1, {"PYTHONPATH": str(tmp_path)})
    (tmp_path / "only_on_this_path.py").write_text("")
    assert imports(server, "only_on_this_path")
    assert not imports(server, "no_such_module_anywhere")


def test_vllm_over_tandem_ttft_per_level() -> None:
    ttft = {
        "tandem": [TtftRow(1, [10.0, 20.0, 30.0]), TtftRow(4, [40.0])],
        "vllm": [TtftRow(1, [15.0, 30.0, 60.0]), TtftRow(4, [20.0])],
    }
    table = format_ratios(ttft).splitlines()
    # p50 30 / 20 and p99 59.4 / 29.8 at one; 20 / 40 both at four
    cells = [[c.strip() for c in line.split("|")[1:4]] for line in table[2:]]
    assert cells == [["1", "1.50", "1.99"], ["4", "0.50", "0.50"]]


def spec_args(*flags: str) -> list[str]:
    return ["speculative-serving", "--model", "llama-1b", "--port", "8500", *VLLM, *flags]


def test_ngram_gives_both_servers_the_same_config_that_tandem_accepts(tmp_path: Path) -> None:
    args = parse(spec_args("--k", "5", "--prompt-lookup-max", "3", "--prompt-lookup-min", "1"))
    tandem, vllm = speculative_serving.build_servers(args, tmp_path)
    at = tandem.command.index("--speculative-config")
    text = tandem.command[at + 1]
    assert vllm.command[vllm.command.index("--speculative-config") + 1] == text
    assert json.loads(text) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }  # fmt: skip
    parsed = SpeculativeConfig.parse(text)
    assert (parsed.num_speculative_tokens, parsed.prompt_lookup_max) == (5, 3)
    assert "--load-format" in vllm.command and vllm.port == 8501
    # vLLM's prompt lookup without numba: its name changes, the sizes do not, ours stays.
    gpu = parse(spec_args("--k", "5", "--vllm-ngram", "ngram_gpu"))
    tandem, vllm = speculative_serving.build_servers(gpu, tmp_path)
    vllm_config = json.loads(vllm.command[vllm.command.index("--speculative-config") + 1])
    assert vllm_config == {
        "method": "ngram_gpu", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }  # fmt: skip
    assert json.loads(tandem.command[at + 1])["method"] == "ngram"
    with pytest.raises(SystemExit, match="--vllm-ngram"):
        speculative_serving.build_servers(
            parse(spec_args("--method", "draft", "--vllm-ngram", "ngram_gpu")), tmp_path
        )


def test_self_drafting_names_each_servers_own_model_and_none_has_no_config(
    tmp_path: Path,
) -> None:
    tandem, vllm = speculative_serving.build_servers(
        parse(spec_args("--method", "draft")), tmp_path
    )

    def config(command: list[str]) -> dict[str, object]:
        return json.loads(command[command.index("--speculative-config") + 1])

    assert config(tandem.command) == {"num_speculative_tokens": 4, "model": "random:llama-1b"}
    assert config(vllm.command) == {"num_speculative_tokens": 4, "model": str(tmp_path / "model")}
    assert SpeculativeConfig.parse(json.dumps(config(tandem.command))).method == "draft_model"
    plain = speculative_serving.build_servers(parse(spec_args("--method", "none")), tmp_path)
    assert all("--speculative-config" not in s.command for s in plain)


def test_vllms_ngram_proposer_without_numba_is_skipped_not_started(tmp_path: Path) -> None:
    (tmp_path / "numba.py").write_text("raise ImportError('not here')\n")
    server = Server("vllm", [sys.executable], 1, {"PYTHONPATH": str(tmp_path)})
    assert not speculative_serving.peer_can_run(server, parse(spec_args()))
    # Its GPU prompt lookup, a draft model and Tandem need no numba.
    assert speculative_serving.peer_can_run(server, parse(spec_args("--vllm-ngram", "ngram_gpu")))
    assert speculative_serving.peer_can_run(server, parse(spec_args("--method", "draft")))
    (tmp_path / "numba.py").write_text("")
    assert speculative_serving.peer_can_run(server, parse(spec_args()))


def test_acceptance_from_either_servers_counters() -> None:
    vllm_text = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="default"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="default"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="default"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="default"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
"""
    after = metric_totals(vllm_text)
    assert after == {"drafts": 10.0, "draft_tokens": 40.0, "accepted": 30.0}
    before = {"drafts": 2.0, "draft_tokens": 8.0, "accepted": 2.0}
    # 28 of 32 drafts kept over 8 steps: 1 + 28 / 8 tokens a step.
    assert spec_rates(before, after) == (28 / 32, 4.5)
    tandem_text = 'tandem_spec_decode_num_drafts_total{model_name="m"} 3.0\n'
    assert metric_totals(tandem_text) == {"drafts": 3.0, "draft_tokens": 0.0, "accepted": 0.0}
    assert spec_rates(before, before) == (None, None)


def test_prefix_cache_hit_rate_and_preemptions_from_either_servers_counters() -> None:
    vllm_text = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 5000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3000.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
"""
    tandem_text = """\
# TYPE tandem_prefix_cache_queries counter
tandem_prefix_cache_queries_total{model_name="m"} 800.0
# TYPE tandem_prefix_cache_hits counter
tandem_prefix_cache_hits_total{model_name="m"} 600.0
"""
    before = {"queries": 1000.0, "hits": 200.0, "preemptions": 2.0}
    after = counter_totals(vllm_text, SERVER_COUNTERS)
    assert after == {"queries": 5000.0, "hits": 3000.0, "preemptions": 12.0}  # both engines
    assert hit_rate(before, after) == 2800 / 4000
    assert preemptions(before, after) == 10
    tandem = counter_totals(tandem_text, SERVER_COUNTERS)
    assert hit_rate(tandem, after) is not None
    assert tandem["preemptions"] is None  # a server without the counter: no count, not 0
    assert preemptions(tandem, after) is None
    assert hit_rate(after, after) is None  # no queries between them
    assert hit_rate(None, after) is None and preemptions(None, after) is None  # no /metrics


def test_a_counter_exported_under_vllms_name_too_counts_once() -> None:
    """Tandem with --metrics-name-alias vllm exports each counter under both names: the
    figures read one of them, not their sum."""
    from frontend.metrics import Metrics
    from protocol.messages import EngineCounts

    metrics = Metrics("m", "vllm")
    counts = EngineCounts(prefix_cache_queries=200, prefix_cache_hits=80, preemptions=5)
    metrics.engine_counts.counts = counts  # as record_engine_stats sets them
    text = metrics.render().decode()
    assert "vllm:num_preemptions_total" in text and "tandem_num_preemptions_total" in text
    totals = counter_totals(text, SERVER_COUNTERS)
    assert totals == {"queries": 200.0, "hits": 80.0, "preemptions": 5.0}


def test_tpot_counts_usage_tokens_not_chunks() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b c d"}}]},  # three tokens in one chunk
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}},
    ]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(200, text=stream)

    body = speculative_serving.chat_body("hi", 5)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        tpot, tokens = stream_tpot(client, "http://peer/v1/chat/completions", body)
    assert tokens == 5 and tpot >= 0
    empty = "data: " + json.dumps(events[-1]) + "\n\n"
    with (
        httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text=empty))) as c,
        pytest.raises(RuntimeError, match="no tokens"),
    ):
        stream_tpot(c, "http://peer/v1/chat/completions", body)


def test_speculative_table_puts_vllm_over_tandem() -> None:
    rows = [
        SpecRow("tandem", 1, 2, 4.0, 4.1, 250.0, 0.5, 3.0),
        SpecRow("vllm", 1, 2, 6.0, 6.2, 160.0, None, None),
    ]
    line = speculative_serving.format_rows(rows).splitlines()[2].split("|")
    assert [c.strip() for c in line[1:-1]] == [
        "1", "4.00", "250", "50", "3.00", "6.00", "160", "-", "-", "1.50"
    ]  # fmt: skip


def test_lora_serves_the_same_adapters_to_both_from_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = parse(["serving", "--model", "llama-1b", "--lora", "2", *VLLM, "--out-dir", "out"])
    out_dir = serving.output_dir(args, "unused-")
    assert out_dir == tmp_path / "out" and out_dir.is_dir()
    loadgen = serving.add_lora_flags(args, out_dir)
    assert loadgen == ["--model", "lora0,lora1"]
    tandem, vllm = serving.build_servers(args, out_dir / "model")
    flags = [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
        f"lora0={out_dir / 'lora' / 'lora0'}", f"lora1={out_dir / 'lora' / 'lora1'}",
    ]  # fmt: skip
    assert tandem.command[-len(flags) :] == flags and vllm.command[-len(flags) :] == flags
    saved = json.loads((out_dir / "lora" / "lora1" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["peft_type"]) == (16, 32, "LORA")
