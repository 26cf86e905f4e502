"""The LoRA adapters this API process serves by name: ``--lora-modules NAME=PATH ...`` at start,
and, with ``--allow-runtime-lora-updates``, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's routes and bodies: ``lora_name``, ``lora_path``).

A request picks an adapter with ``"model": NAME``; its engine requests then carry the adapter's
``LoraRef`` (name and folder), and the engine core reads the folder when it has no copy
(docs/design/lora.md). Each adapter is read and checked here before its name is served, with
the engine's own loader, so a bad adapter is refused at start or by the load route naming the
problem rather than failing the requests that name it. Unloading stops serving the name; the
requests already sent with it finish with it.

The engine core keys an adapter (its host copy, its device slot, its prefix-cache entries) by
name and folder, and an unload tells it nothing. So a load at run time serves a private copy of
the files it checked: loading a name again after its folder's files changed is a new adapter
to the engine, never the old copy, nor old cached K/V beside new weights. The copies last as long
as this process.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engine_core.config import ModelConfig
from engine_core.lora.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraError,
    check_lora_model,
    load_adapter,
)
from frontend.errors import OpenAIError, bad_request
from frontend.lora_args import parse_lora_modules
from protocol.codec import lora_text_problem
from protocol.messages import LoraRef


@dataclass
class LoraRegistry:
    """The adapters served by name; every one was read and checked before it was added."""

    base_name: str  # the base model's served name: /v1/models lists it as their parent
    model_config: ModelConfig  # what adapters are checked against
    max_rank: int  # --max-lora-rank
    runtime_updates: bool = False  # --allow-runtime-lora-updates
    adapters: dict[str, LoraRef] = field(default_factory=dict)
    # The folder each adapter was loaded from (/v1/models' root); a runtime load's LoraRef
    # names its private copy instead (the module docstring).
    sources: dict[str, str] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _copies: tempfile.TemporaryDirectory[str] | None = None
    _num_copies: int = 0

    def __post_init__(self) -> None:
        check_lora_model(self.model_config)

    def check(self, path: str) -> str:
        """Read the adapter at ``path`` as the engine will; its resolved path, which requests
        carry to the engine. LoraError naming what is wrong."""
        load_adapter(path, self.model_config, self.max_rank)
        resolved = str(Path(path).resolve())
        problem = lora_text_problem(resolved, "the adapter folder's full path")
        if problem is not None:
            raise LoraError(problem)
        return resolved

    def add_checked(self, modules: dict[str, str]) -> None:
        """The --lora-modules adapters, each read and checked (ValueError naming a bad one)."""
        for name, path in modules.items():
            try:
                resolved = self.check(path)
            except LoraError as exc:
                raise ValueError(f"--lora-modules {name}: {exc}") from None
            self.adapters[name] = LoraRef(name, resolved)
            self.sources[name] = resolved

    def resolve(self, model: str | None) -> LoraRef | None:
        """The adapter a request's ``model`` names; None for the base model (or no name)."""
        if model is None or model == self.base_name:
            return None
        ref = self.adapters.get(model)
        if ref is None:
            raise model_not_found(model, self.base_name, list(self.adapters))
        return ref

    async def load(self, name: str, path: str) -> str:
        """Check and add an adapter (load_lora_adapter); the success message."""
        self._check_updates()
        if not name or not path:
            raise bad_request("give both lora_name and lora_path", "lora_name")
        for text, param in ((name, "lora_name"), (path, "lora_path")):
            problem = lora_text_problem(text, param)
            if problem is not None:
                raise bad_request(problem, param)
        async with self._lock:  # two loads of one name: the second is told it exists
            if name == self.base_name:
                raise bad_request(f"'{name}' is the base model's name: give the adapter another")
            if name in self.adapters:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.")
            try:
                resolved = await asyncio.to_thread(self.check, path)
                copy = await asyncio.to_thread(self._copy, resolved)
            except LoraError as exc:
                raise bad_request(str(exc), "lora_path", "invalid_lora_adapter") from None
            self.adapters[name] = LoraRef(name, copy)
            self.sources[name] = resolved
        return f"Success: LoRA adapter '{name}' added successfully."

    def _copy(self, folder: str) -> str:
        """A private copy of a checked adapter's files, which the engine core reads."""
        if self._copies is None:
            self._copies = tempfile.TemporaryDirectory(prefix="tandem-lora-")
        self._num_copies += 1
        copy = Path(self._copies.name) / str(self._num_copies)
        copy.mkdir()
        try:
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                shutil.copyfile(Path(folder) / file, copy / file)
        except OSError as exc:  # the folder changed under us, or no room for the copy
            raise LoraError(f"{folder}: could not copy the adapter to serve it: {exc}") from None
        return str(copy)

    def unload(self, name: str) -> str:
        """Stop serving an adapter (unload_lora_adapter): requests already sent with it finish
        with it; new ones naming it get 404."""
        self._check_updates()
        self.sources.pop(name, None)
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(
                404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name"
            )
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_updates(self) -> None:
        if not self.runtime_updates:
            raise OpenAIError(
                403,
                "Loading and unloading LoRA adapters at run time is off: start tandem serve "
                "with --allow-runtime-lora-updates",
                "forbidden",
                code="lora_updates_disabled",
            )


def lora_registry(args: argparse.Namespace, engine_model: str, check: bool = False) -> LoraRegistry:
    """The API process's adapters, where LoRA is on (frontend/lora_args.py ``lora_on``).
    ``check``: read and check each --lora-modules adapter first (the serve process does, before
    the engines start; the API processes then trust it)."""
    modules = parse_lora_modules(args.lora_modules)
    name = args.served_model_name or args.model
    registry = LoraRegistry(
        name, served_model_config(engine_model), args.max_lora_rank,
        args.allow_runtime_lora_updates,
    )  # fmt: skip
    if check:
        registry.add_checked(modules)
    else:
        registry.adapters = {n: LoraRef(n, str(Path(p).resolve())) for n, p in modules.items()}
        registry.sources = {n: ref.path for n, ref in registry.adapters.items()}
    return registry


def served_model_config(engine_model: str) -> ModelConfig:
    """The base model's config, as the engine core reads it (a folder or a random preset)."""
    from engine_core.loader import load_model_config
    from engine_core.model_dir import RANDOM_PREFIX
    from engine_core.models import model_config_from_hf
    from engine_core.presets import hf_config

    if engine_model.startswith(RANDOM_PREFIX):
        return model_config_from_hf(hf_config(engine_model.removeprefix(RANDOM_PREFIX)))
    return load_model_config(Path(engine_model))


def model_not_found(model: str, base: str, adapters: list[str]) -> OpenAIError:
    served = ", ".join(f"`{name}`" for name in [base, *adapters])
    return OpenAIError(
        404,
        f"The model `{model}` does not exist. Served: {served}.",
        param="model",
        code="model_not_found",
    )
