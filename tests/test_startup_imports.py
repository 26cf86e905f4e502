"""Start-up imports only what it needs (docs/design/start-up-time.md): each check runs one start
path in a fresh interpreter and lists the heavy modules it left in ``sys.modules``. An invariant
rather than a timing, so it holds on a loaded machine; each module named here is installed, so a
regression that imports it fails the test."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Optional or feature-only libraries that no start path needs unless its flag asks for it.
OPTIONAL = ("PIL", "llguidance", "gguf", "compressed_tensors", "peft", "transformers", "sympy")
HTTP_STACK = ("fastapi", "starlette", "pydantic", "jinja2", "tokenizers")
# The engine-side libraries: `tandem serve` starts its engine cores before it imports them, and
# its API process never does.
ENGINE_STACK = ("torch", "safetensors")

SERVE_BEFORE_ENGINES = """
from frontend import serve
from frontend.cli import build_parser
from frontend.engines import plan_engines
from engine_core.model_dir import resolve_for_serving

args = build_parser("serve").parse_args(["serve", "--model", MODEL])
curve = serve.check_args(args)
engine_model, _ = resolve_for_serving(args.model)
serve.check_lora_modules(args, engine_model)
plan_engines(args, engine_model, curve, None)
"""
API_PROCESS = """
import frontend.api_processes, frontend.app, frontend.http_server
"""
# The API process's tokenizer, loaded as it loads it: AutoTokenizer's configuration classes
# would import torch (transformers/modeling_rope_utils.py), so a folder that takes the direct
# path (common/hf_tokenizer.py) must not.
API_TOKENIZER = """
from pathlib import Path
from common.hf_tokenizer import loads_backend_directly
from frontend.tokenizer import load_hf_tokenizer
assert loads_backend_directly(Path(MODEL))
tokenizer = load_hf_tokenizer(Path(MODEL))
tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
"""
ENGINE_PROCESS = """
from frontend.cli import build_parser
from engine_core.args import engine_config_from_args
from engine_core.core import EngineCore

args = build_parser("engine").parse_args(["engine", "--model", MODEL])
EngineCore(engine_config_from_args(args))
"""

# What `tandem COMMAND --help`, or a flag it refuses, costs: building the command's parser.
COMMAND_PARSERS = """
from frontend.cli import COMMANDS, build_parser
for command in COMMANDS:
    build_parser(command)
"""


def imported(code: str, model: Path, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has imported after running ``code``."""
    script = f"MODEL = {str(model)!r}\n{textwrap.dedent(code)}\n" + (
        f"import json, sys\nprint(json.dumps([m for m in {watched!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("code", "watched"),
    [
        (SERVE_BEFORE_ENGINES, ENGINE_STACK + HTTP_STACK + OPTIONAL + ("opentelemetry",)),
        (API_PROCESS, ENGINE_STACK + OPTIONAL),
        (ENGINE_PROCESS, HTTP_STACK + OPTIONAL + ("opentelemetry", "torch._dynamo")),
        (API_TOKENIZER, ENGINE_STACK),
        (COMMAND_PARSERS, ENGINE_STACK + HTTP_STACK + OPTIONAL),
    ],
    ids=["serve-before-engines", "api-process", "engine-process", "api-tokenizer", "parsers"],
)
def test_a_start_path_imports_no_heavy_module_it_does_not_use(
    code: str, watched: tuple[str, ...], tiny_model_dir: Path
) -> None:
    assert imported(code, tiny_model_dir, watched) == []


def test_the_check_sees_an_import() -> None:
    """The watch itself works: a module the code imports is listed, one it does not is not."""
    assert imported("import csv", REPO, ("csv", "wave")) == ["csv"]
