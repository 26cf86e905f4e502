"""The LoRA flags of `tandem serve` and their checks, apart from frontend/lora.py (which reads
adapters with the engine's loader, and so imports torch) so that parsing the command line does
not import it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from protocol.codec import lora_text_problem


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="PEFT LoRA adapters to serve, each under its NAME: a request with "
        '"model": NAME runs with it (listed by /v1/models with the base model as parent); '
        'or, as vLLM takes them, JSON: \'{"name": NAME, "path": PATH}\' with an optional '
        '"base_model_name", which must be the served model\'s name',
    )  # fmt: skip
    group.add_argument(
        "--allow-runtime-lora-updates", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (bodies: "
        "lora_name, lora_path; behind --api-key when set): vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING as a flag (default: off)",
    )  # fmt: skip


@dataclass(frozen=True)
class LoraModule:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None  # JSON form only: checked against the served name


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """Each adapter's path by name; ValueError naming a malformed or repeated entry."""
    return {module.name: module.path for module in lora_modules(values)}


def lora_modules(values: list[str] | None) -> list[LoraModule]:
    """The --lora-modules entries, ``NAME=PATH`` or vLLM's JSON form; ValueError naming a
    malformed or repeated one."""
    modules: list[LoraModule] = []
    for value in values or []:
        module = _json_module(value) if value.lstrip().startswith("{") else _pair_module(value)
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        problem = lora_text_problem(module.name, "the name") or lora_text_problem(
            module.path, "the path"
        )
        if problem is not None:
            raise ValueError(f"--lora-modules {value[:80]!r}: {problem}")
        modules.append(module)
    return modules


def _pair_module(value: str) -> LoraModule:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: give NAME=PATH or a JSON object")
    return LoraModule(name, path)


_JSON_KEYS = {"name", "path", "base_model_name"}


def _json_module(value: str) -> LoraModule:
    try:
        entry = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--lora-modules {value[:80]!r}: not valid JSON ({exc.msg})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"--lora-modules {value[:80]!r}: give a JSON object")
    unknown = sorted(set(entry) - _JSON_KEYS)
    if unknown:
        raise ValueError(
            f"--lora-modules {value[:80]!r}: unknown key {unknown[0]!r} (known: name, path, "
            "base_model_name)"
        )
    for key in ("name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"--lora-modules {value[:80]!r}: {key!r} must be a non-empty string")
    base = entry.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {value[:80]!r}: 'base_model_name' must be a string")
    return LoraModule(entry["name"], entry["path"], base)


def check_lora_args(args: argparse.Namespace) -> None:
    """ValueError for LoRA flags that do not go together."""
    entries = lora_modules(args.lora_modules)
    modules = {m.name: m.path for m in entries}
    local = not args.remote_engine
    if local and not args.enable_lora and (modules or args.allow_runtime_lora_updates):
        given = "--lora-modules" if modules else "--allow-runtime-lora-updates"
        raise ValueError(f"{given} needs --enable-lora (the engine core's adapter slots)")
    from frontend.engines import changed_engine_flags  # serve's check of flags past defaults

    sizes = [flag for flag in changed_engine_flags(args) if flag in LORA_SIZE_FLAGS]
    if local and not args.enable_lora and sizes:
        raise ValueError(f"{sizes[0]} sizes the adapter slots: it needs --enable-lora")
    if args.allow_runtime_lora_updates and args.api_servers > 1:
        raise ValueError(
            "--allow-runtime-lora-updates with --api-servers > 1 is not supported: each API "
            "process keeps its own list of adapters, and a load would reach only one of them"
        )
    name = args.served_model_name or args.model
    if name in modules:
        raise ValueError(f"--lora-modules: {name!r} is the base model's name")
    for m in entries:  # one base model is served: an adapter for another would be wrong
        if m.base_model_name is not None and m.base_model_name != name:
            raise ValueError(
                f"--lora-modules {m.name!r}: base_model_name {m.base_model_name!r} is not the "
                f"served model {name!r}"
            )


LORA_SIZE_FLAGS = ("--max-loras", "--max-lora-rank", "--max-cpu-loras")


def lora_on(args: argparse.Namespace) -> bool:
    """LoRA is served: ``--enable-lora``, or adapters named (for a remote engine). Asked before
    importing frontend/lora.py, which imports torch and the HTTP stack."""
    return bool(args.enable_lora or parse_lora_modules(args.lora_modules))
