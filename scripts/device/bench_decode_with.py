"""scripts/bench_decode.py in process with module constants set first, for A/B runs of a
setting that has no flag (the GPU machine):

    python scripts/device/bench_decode_with.py engine_core.models.skinny_gemm.SHORT_K=0 \\
        [MODULE.NAME=VALUE ...] -- --paths inproc --no-hf --no-profile --models smollm2-135m

Each NAME must exist already; VALUE is parsed as the type of its current value (int, float,
bool as 0/1/true/false, str). Only the in-process path: a ZMQ engine is another process, which
would not see the settings.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode  # noqa: E402


def parse_value(current: object, text: str) -> object:
    if isinstance(current, bool):
        if text.lower() not in ("0", "1", "true", "false"):
            raise SystemExit(f"{text!r} is not a bool (0, 1, true, false)")
        return text.lower() in ("1", "true")
    if isinstance(current, (int, float, str)):
        return type(current)(text)
    raise SystemExit(f"cannot set a {type(current).__name__} from the command line")


def apply(setting: str) -> None:
    target, sep, text = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"{setting!r}: expected MODULE.NAME=VALUE")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"{module_name} has no {name}")
    value = parse_value(getattr(module, name), text)
    setattr(module, name, value)
    print(f"set {module_name}.{name} = {value!r}", flush=True)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    settings, bench_args = argv[:split], argv[split + 1 :]
    paths = bench_args[bench_args.index("--paths") + 1] if "--paths" in bench_args else ""
    if paths != "inproc":
        raise SystemExit("give --paths inproc: an engine process would not see the settings")
    for setting in settings:
        apply(setting)
    return bench_decode.main(bench_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
