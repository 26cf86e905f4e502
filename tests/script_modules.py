"""Import a script of scripts/ (not a package) as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/``name``.py (``name`` may hold a folder) as the module ``<stem>_under_test``."""
    module_name = f"{Path(name).name}_under_test"
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the body runs
    spec.loader.exec_module(module)
    return module
