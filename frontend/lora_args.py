"""The LoRA flags of `tandem serve` and their checks, apart from frontend/lora.py (which reads
adapters with the engine's loader, and so imports torch) so that parsing the command line does
not import it."""

from __future__ import annotations

import argparse

from protocol.codec import lora_text_problem


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="PEFT LoRA adapters to serve, each under its NAME: a request with "
        '"model": NAME runs with it (listed by /v1/models with the base model as parent)',
    )  # fmt: skip
    group.add_argument(
        "--allow-runtime-lora-updates", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (bodies: "
        "lora_name, lora_path; behind --api-key when set): vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING as a flag (default: off)",
    )  # fmt: skip


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """``NAME=PATH`` pairs by name; ValueError naming a malformed or repeated one."""
    modules: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: give NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        problem = lora_text_problem(name, "the name") or lora_text_problem(path, "the path")
        if problem is not None:
            raise ValueError(f"--lora-modules {value[:80]!r}: {problem}")
        modules[name] = path
    return modules


def check_lora_args(args: argparse.Namespace) -> None:
    """ValueError for LoRA flags that do not go together."""
    modules = parse_lora_modules(args.lora_modules)
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


LORA_SIZE_FLAGS = ("--max-loras", "--max-lora-rank", "--max-cpu-loras")


def lora_on(args: argparse.Namespace) -> bool:
    """LoRA is served: ``--enable-lora``, or adapters named (for a remote engine). Asked before
    importing frontend/lora.py, which imports torch and the HTTP stack."""
    return bool(args.enable_lora or parse_lora_modules(args.lora_modules))
