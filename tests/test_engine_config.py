"""Engine limits that cannot work together are refused up front, with a message naming them,
by the config and by every command that takes them (vLLM refuses the same)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig


def test_a_token_budget_below_the_sequence_cap_is_refused() -> None:
    """Each running sequence takes a token of every step's budget: below the cap, the last
    decodes of a full batch would stall and nothing new would be admitted."""
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(8\).*--max-num-seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    EngineConfig(max_num_seqs=16, max_num_batched_tokens=16)  # equal is fine


@pytest.mark.parametrize(
    "name",
    [
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "num_kv_blocks",
        "prefill_max_batch_size",  # negative: no request was ever admitted; 0 was "unset"
        "data_parallel_size",  # 0 planned no engine, and serve died on an IndexError
    ],
)
def test_limits_must_be_positive(name: str) -> None:
    flag = "--" + name.replace("_", "-")
    for value in (0, -1):
        with pytest.raises(ValueError, match=f"{flag} must be at least 1"):
            EngineConfig(**{name: value})


@pytest.mark.parametrize(
    ("field", "value"), [("dtype", "float7"), ("device", "tpu"), ("device", "cuda:x")]
)
def test_an_unknown_dtype_or_device_is_refused_by_its_flag(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"--{field} {value!r}"):
        EngineConfig(**{field: value})


# Each used to reach the engine process (a traceback, then "the engine process exited before
# its handshake"), or to start a server that never came up (--max-model-len -1) or came up on
# another port (--port 99999), or open (--api-key '').
BAD_SERVE_FLAGS = [
    (["--max-model-len", "-1"], "--max-model-len must be at least 1"),
    (["--dtype", "float7"], "--dtype 'float7'"),
    (["--model", "/nonexistent"], "model path not found: /nonexistent"),
    (["--model", "random:nope"], "no preset 'nope'"),
    (["--port", "99999"], "a TCP port is 0 to 65535"),
    (["--api-key", ""], "an empty key would leave the API open"),
    (["--chat-template", "/nonexistent"], "cannot read /nonexistent"),
    (["--log-level", "bogus"], "invalid choice: 'BOGUS'"),
    (["--engine-timeout", "-1"], "must be at least 1 s"),
    (["--max-body-bytes", "-1"], "must be at least 1"),
    (["--grammar-timeout", "0"], "must be more than 0"),
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization is a share"),
    (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb must be a number of GiB above 0"),
    (["--kv-cache-memory-gb", "nan"], "--kv-cache-memory-gb must be a number of GiB above 0"),
    (["--speculative-config", '{"method": "ngram"}'], 'needs "num_speculative_tokens"'),
    (["--max-lora-rank", "64"], "--max-lora-rank sizes the adapter slots"),
    # Each of these was accepted, then failed later: every sampled request (a seed torch cannot
    # take), every request (a timeout under the heartbeat), a traceback (a bad address, no
    # engines), or the engine at the first POST /start_profile (a file as the folder).
    (["--seed", str(2**64)], "--seed 18446744073709551616 is outside what a generator takes"),
    (["--seed", str(-(2**63) - 1)], "is outside what a generator takes"),
    (["--engine-timeout", "0.4"], "must be at least 1 s (the engine sends a heartbeat every 0.5 s"),
    (["--engine", "foo://bar"], "--engine: engine address must start with ipc:// or tcp://"),
    (["--engine-address", "tcp://127.0.0.1:99999"], "--engine-address: port out of range"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
    (["--profile-dir", f"{__file__}/traces"], f"{__file__} is not a folder"),
    (["--kv-offload-gb", "nan"], "--kv-offload-gb must be a number of GiB, 0 (off) or more"),
    (["--kv-offload-gb", "inf"], "--kv-offload-gb must be a number of GiB, 0 (off) or more"),
    (["--encoder-cache-memory-gb", "-1"], "--encoder-cache-memory-gb must be a number of GiB"),
    (["--dist-timeout", "-5"], "--dist-timeout -5.0 must be positive"),
]


@pytest.mark.parametrize(("flags", "words"), BAD_SERVE_FLAGS, ids=lambda x: str(x))
def test_serve_refuses_a_bad_flag_at_once_naming_it(flags: list[str], words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["engine"],
        ["client", "--address", "ipc:///tmp/x", "--token-ids", "1"],
        ["generate", "--prompt", "hi"],
        ["bench"],
        ["keygen", "--dir", "/tmp", "--name", "x"],
    ],
    ids=lambda command: command[0],
)
def test_an_unknown_flag_is_refused_with_the_commands_usage(command: list[str]) -> None:
    """The command's own usage line, not the top-level one, which lists no flag."""
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", *command, "--no-such-flag"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    name = command[0]
    assert result.stderr.startswith(f"usage: tandem {name} "), result.stderr
    assert f"tandem {name}: error: unrecognized arguments: --no-such-flag" in result.stderr


def test_a_generate_prompt_that_is_not_utf8_is_refused_before_loading() -> None:
    """argv bytes that are no UTF-8 (lone surrogates in Python) never reach the tokenizer."""
    cli = [sys.executable.encode(), b"-m", b"frontend.cli", b"generate", b"--prompt", b"\xff\xfe"]
    result = subprocess.run(cli, capture_output=True, timeout=120)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "argument --prompt: not valid UTF-8 text" in stderr and "Traceback" not in stderr


def test_a_flag_before_the_command_is_tandems_to_refuse() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "--no-such-flag", "serve"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("usage: tandem [-h] COMMAND"), result.stderr
    assert "tandem: error: unrecognized arguments: --no-such-flag" in result.stderr


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (["generate", "--prompt", "hi", "--model", "random:nope"], "unknown preset 'nope'"),
        (["client", "--address", "bogus", "--token-ids", "1"], "must start with ipc:// or tcp://"),
        (["bench", "--request-rate", "-1"], "--request-rate: must be more than 0"),
        (["bench", "--address", "ipc:///tmp/x"], "--address is the engine's, for --backend zmq"),
        (
            ["engine", "--address", "ipc:///nonexistent/dir/engine"],
            "does not exist: /nonexistent/dir",
        ),
        (["bench", "--input-len", "abc"], "--input-len: bad length 'abc'"),
        (["bench", "--request-timeout", "-1"], "--request-timeout: must be more than 0"),
        (["bench", "--connect-timeout", "0"], "--connect-timeout: must be more than 0"),
        (
            ["generate", "--prompt", "hi", "--profile-dir", "/tmp/p"],
            "profile_dir: the offline API has no profiler to start",
        ),
    ],
    ids=lambda x: str(x),
)
def test_other_commands_refuse_bad_input_without_a_traceback(
    command: list[str], words: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", *command],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["serve", "engine", "generate"])
def test_commands_refuse_it_with_the_message_and_no_traceback(command: str) -> None:
    extra = ["--prompt", "hi"] if command == "generate" else []
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", command, "--max-num-seqs", "16",
         "--max-num-batched-tokens", "8", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--max-num-batched-tokens (8) must be at least --max-num-seqs (16)" in (result.stderr)
    assert "Traceback" not in result.stderr


def test_engine_flags_with_a_remote_engine_are_refused() -> None:
    """With --engine ADDRESS nothing is started here: an engine flag would be silently ignored
    (the remote engine runs with its own), so it is refused, naming it."""
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--engine", "tcp://127.0.0.1:9",
         "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--max-num-seqs: engine flags set up an engine core that tandem serve starts" in (
        result.stderr
    )


def test_a_negative_prefill_graph_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-prefill-graph-tokens must be 0"):
        EngineConfig(max_prefill_graph_tokens=-1)
    EngineConfig(max_prefill_graph_tokens=0)  # 0 turns prefill graphs off


def test_an_unknown_tp_all_reduce_is_refused() -> None:
    with pytest.raises(ValueError, match="--tp-all-reduce 'custom' is not supported; choose one"):
        EngineConfig(tp_all_reduce="custom")
    for value in ("auto", "nccl"):
        EngineConfig(tp_all_reduce=value)


def test_an_unset_sequence_cap_is_the_large_default_only_on_a_large_gpu() -> None:
    """--max-num-seqs unset: vLLM's 1,024 on a large GPU, 256 elsewhere, never past the
    step's token budget; a value given is kept as it is."""
    unset = EngineConfig()
    assert unset.max_num_seqs is None
    assert unset.with_max_num_seqs(large_gpu=False).max_num_seqs == 256
    assert unset.with_max_num_seqs(large_gpu=True).max_num_seqs == 1024
    small_budget = EngineConfig(max_num_batched_tokens=512)
    assert small_budget.with_max_num_seqs(large_gpu=True).max_num_seqs == 512
    assert small_budget.with_max_num_seqs(large_gpu=False).max_num_seqs == 256
    given = EngineConfig(max_num_seqs=64)
    assert given.with_max_num_seqs(large_gpu=True) is given


@pytest.mark.parametrize(
    ("model", "gib", "expected"),
    [
        ("random:llama-8b", 80, 1024),  # an H100 or larger
        ("random:llama-8b", 140, 1024),
        ("random:llama-8b", 48, 256),  # an L40S
        # Linear-attention layers: a state slot per running sequence (and as many saved).
        ("random:qwen3-next-80b", 140, 256),
    ],
)
def test_the_runner_resolves_the_cap_from_the_gpus_memory_and_the_model(
    monkeypatch: pytest.MonkeyPatch, model: str, gib: int, expected: int
) -> None:
    """The rule as the runner applies it, with the GPU's size as torch reports it (set here: the
    machine that runs the tests has no GPU)."""
    import torch

    from engine_core.model_runner import resolve_max_num_seqs

    class Properties:
        total_memory = gib * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, as said above
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = resolve_max_num_seqs(EngineConfig(model=model, device="cuda"))
    assert config.max_num_seqs == expected
    assert resolve_max_num_seqs(EngineConfig(model=model, device="cpu")).max_num_seqs == 256
    explicit = EngineConfig(model=model, device="cuda", max_num_seqs=32)
    assert resolve_max_num_seqs(explicit).max_num_seqs == 32


def test_the_runner_resolves_the_token_budget_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-num-batched-tokens unset: 8192 on a GPU, 4096 on the CPU (at least
    --max-num-seqs); given, as given. Unresolved, a config reads as 8192 (token_budget)."""
    import torch

    from engine_core.model_runner import resolve_max_num_seqs

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def budget(**kwargs: object) -> int | None:
        config = EngineConfig(model="random:llama-1b", **kwargs)  # type: ignore[arg-type]
        return resolve_max_num_seqs(config).max_num_batched_tokens

    assert EngineConfig().max_num_batched_tokens is None and EngineConfig().token_budget == 8192
    assert budget(device="cuda") == 8192
    assert budget(device="cpu") == 4096
    assert budget(device="cpu", max_num_seqs=6000) == 6000
    assert budget(device="cpu", max_num_batched_tokens=8192) == 8192
    cpu = resolve_max_num_seqs(EngineConfig(model="random:llama-1b", device="cpu"))
    assert (cpu.token_budget, cpu.max_num_seqs) == (4096, 256)


def test_the_cap_takes_the_model_config_its_caller_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism's rank 0 has read config.json for its checks: the cap decides from
    that config (here a linear-attention model's, named against llama-8b's preset, so the
    answer tells which one decided) and reads nothing again."""
    import torch

    from engine_core import model_runner
    from engine_core.presets import PRESETS

    class Properties:
        total_memory = 140 * 2**30

    def no_second_read(model: str) -> None:
        raise AssertionError(f"{model}'s config read again")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, as said above
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(model_runner, "peek_model_config", no_second_read)
    config = EngineConfig(model="random:llama-8b", device="cuda")
    hybrid = PRESETS["qwen3-next-80b"]
    assert model_runner.resolve_max_num_seqs(config, hybrid).max_num_seqs == 256
    assert model_runner.resolve_max_num_seqs(config, PRESETS["llama-8b"]).max_num_seqs == 1024


def test_an_engine_on_the_cpu_runs_256_sequences_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real engine resolves the unset cap once: its config, its scheduler and its runner
    agree, and a request beyond it waits (256 admitted of 257 one-token prompts)."""
    from engine_core.core import EngineCore
    from engine_core.request import Request
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    with caplog.at_level(logging.INFO, logger="engine_core.model_runner"):
        core = EngineCore(EngineConfig(model=str(write_tiny_llama(tmp_path)), device="cpu"))
    assert "--max-num-seqs unset: 256 running sequences at most" in caplog.text
    assert core.config.max_num_seqs == core.runner.config.max_num_seqs == 256
    assert core.scheduler.config.max_num_seqs == 256
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(257):
        core.add_request(Request(f"r{i}", [3 + i % 100], params))
    core.step()
    assert core.scheduler.num_running == 256


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--host", "0.0.0.0"], True),
        (["--host", "10.1.2.3"], True),
        (["--host", "0.0.0.0", "--api-key", "k"], False),
        ([], False),  # 127.0.0.1
        (["--host", "localhost"], False),
        (["--host", "::1"], False),
        (["--port", "0"], False),  # a free port the system picks
        (["--host", "0.0.0.0", "--port", "0"], True),
        (["--host", ""], True),  # every interface, as uvicorn takes it
    ],
)
def test_serving_past_loopback_without_an_api_key_is_said_at_start(
    flags: list[str], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Allowed, as in vLLM (a pod behind its Service), but never silently open."""
    from frontend import serve
    from frontend.cli import build_parser

    args = build_parser("serve").parse_args(["serve", *flags])
    with caplog.at_level(logging.WARNING, logger="tandem.serve"):
        serve.warn_if_open(args)
    assert ("without --api-key" in caplog.text) == warned


def test_serving_a_folder_without_a_tokenizer_says_so_in_one_line(tmp_path: Path) -> None:
    """The weights load and the engine serves, but the API cannot tokenize: serve names the
    folder and what it lacks, with no traceback (transformers' own message advised installing
    sentencepiece), and stops its engine."""
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "no-tokenizer")
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model_dir), "--port", "0",
         "--num-kv-blocks", "16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"cannot load the tokenizer of {model_dir} (it has none of tokenizer.json" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr and "never retrieved" not in result.stderr
    # With several API processes, each loads the tokenizer: the first that cannot ends serve
    # (it had been restarted for ever, and serve never exited).
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model_dir), "--port", "0",
         "--num-kv-blocks", "16", "--api-servers", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"cannot load the tokenizer of {model_dir}" in result.stderr
    assert "cannot serve (its error above)" in result.stderr
    assert "restarting it" not in result.stderr and "Traceback" not in result.stderr
    # Offline, with the chat template asked for: the same one line.
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "generate", "--model", str(model_dir), "--chat",
         "--prompt", "hi", "--max-tokens", "2", "--num-kv-blocks", "16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"tandem generate: cannot load the tokenizer of {model_dir}" in result.stderr
    assert "`tandem client --token-ids`" in result.stderr  # a command line's way, not the API's
    assert "Traceback" not in result.stderr
    # Without weights too, the engine fails first: its reason, and nothing of the tokenizer's.
    (model_dir / "model.safetensors").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model_dir), "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "has no *.safetensors or pytorch_model.bin weights" in result.stderr
    assert "Traceback" not in result.stderr and "never retrieved" not in result.stderr


def test_a_max_model_len_the_model_or_the_pool_cannot_hold_is_refused_at_start(
    tmp_path: Path,
) -> None:
    """Past the model's positions, or past what --num-kv-blocks hold for one sequence, an asked
    --max-model-len is refused before the weights load, in one line naming it (both were
    lowered with a warning, so requests the flag promised were refused later); unset, the
    pool's bound is served."""
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "tiny", max_positions=128)
    serve = [
        sys.executable,
        "-m",
        "frontend.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
    ]
    cases = [
        (["--max-model-len", "256"], "--max-model-len 256 is past the model's 128 positions"),
        # Before any tensor-parallel rank starts (each printed its own traceback).
        (["--max-model-len", "256", "--tensor-parallel-size", "2"],
         "--max-model-len 256 is past the model's 128 positions"),
        (["--max-model-len", "128", "--num-kv-blocks", "4"],
         "--num-kv-blocks 4 holds less than one sequence of --max-model-len 128 (8 blocks of 16 "
         "tokens)"),
    ]  # fmt: skip
    for flags, words in cases:
        result = subprocess.run(
            [*serve, "--port", "0", *flags], capture_output=True, text=True, timeout=300
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert words in result.stderr
        assert "Traceback" not in result.stderr
    # Unset, the model's 128 positions are lowered to the 64 tokens the pool holds.
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams

    llm = LLM(str(model_dir), num_kv_blocks=4, block_size=16)
    try:
        assert llm.engine.max_model_len == 64
        with pytest.raises(ValueError, match="within max_model_len=64"):
            llm.generate([[5] * 65], SamplingParams(max_tokens=1), detokenize=False)
    finally:
        llm.engine.shutdown()


def test_a_chat_template_that_does_not_parse_is_refused_at_start(tmp_path: Path) -> None:
    """It would fail every chat request with a 500 (it did); templates parse as HF renders
    them, so loop controls are Jinja there."""
    from common.chat_template import check_chat_template_file

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "--chat-template", str(broken)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"--chat-template {broken}: not a Jinja template" in result.stderr
    assert "(line 1)" in result.stderr and "Traceback" not in result.stderr
    with_break = tmp_path / "break.jinja"
    with_break.write_text("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}")
    check_chat_template_file(str(with_break))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8 text"):
        check_chat_template_file(str(latin1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a CUDA GPU")
def test_a_cuda_device_without_cuda_is_refused_by_its_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "generate", "--prompt", "hi", "--device", "cuda"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--device cuda: this machine (or its torch build) has no CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_ctrl_c_during_tandem_generate_is_one_line_and_exit_code_130() -> None:
    """SIGINT 2 s in (while it imports, loads the model or generates: each is cut the same
    way): one line, exit code 130, as `tandem client` says it, not a traceback through torch."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "generate", "--prompt", "Tell a long story",
         "--max-tokens", "1500", "--temperature", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # A CI run in the background starts with SIGINT ignored, which a child inherits.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        time.sleep(2)
        assert proc.poll() is None, "it ended before the signal"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert stderr.rstrip().endswith("tandem generate: interrupted") and "Traceback" not in stderr


@pytest.mark.parametrize(
    ("command", "listed"), [("serve", True), ("engine", True), ("generate", False)]
)
def test_profile_dir_is_listed_only_where_it_is_honoured(command: str, listed: bool) -> None:
    """`tandem generate` parses --profile-dir only to refuse it, so its --help leaves it out."""
    from frontend.cli import build_parser, subcommand_parser

    text = subcommand_parser(build_parser(command), command).format_help()
    assert ("--profile-dir" in text) == listed
