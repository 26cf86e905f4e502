"""How llguidance's parallel mask fill scales on the GPU machine: 64 matchers of
scripts/bench_structured.py's records schema, advanced by the argmax of random logits, filled on
1 or 12 threads, as copies of one compiled matcher or each compiled on its own.

    TANDEM_TOKENIZER_DIR=.tok python scripts/device/mask_parallel.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_structured import LONG_SCHEMAS  # noqa: E402

from engine_core.grammar import allocate_bitmask, compile_matcher, token_table  # noqa: E402
from protocol.messages import Constraint, ConstraintKind  # noqa: E402

ROWS = 64
STEPS = 100
VOCAB = 49152


def allowed(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, V] bool from the int32 words."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :VOCAB].bool()


def time_fills(matchers: list[Any], threads: int) -> list[float]:
    rng = np.random.default_rng(0)
    bitmask = allocate_bitmask(len(matchers), VOCAB)
    executor = llguidance.LLExecutor(num_threads=threads)
    rows = [(m, i) for i, m in enumerate(matchers)]
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, rows, bitmask)
        seconds.append(time.perf_counter() - start)
        logits = torch.from_numpy(rng.standard_normal((len(matchers), VOCAB)).astype(np.float32))
        logits[~allowed(bitmask)] = -float("inf")
        for matcher, token in zip(matchers, logits.argmax(-1).tolist(), strict=True):
            assert matcher.consume_token(token)
    return sorted(seconds)


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(os.environ["TANDEM_TOKENIZER_DIR"])
    table = token_table(tokenizer, VOCAB)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(LONG_SCHEMAS["records"]))
    template = compile_matcher(constraint, table)
    for threads, copies in ((1, True), (12, True), (1, False), (12, False)):
        if copies:
            matchers = [template.deep_copy() for _ in range(ROWS)]
        else:
            matchers = [compile_matcher(constraint, table) for _ in range(ROWS)]
        times = time_fills(matchers, threads)
        kind = "copies of one compiled matcher" if copies else "each compiled on its own"
        print(
            f"threads {threads}, {kind}: {ROWS}-row fill median "
            f"{times[STEPS // 2] * 1e3:.2f} ms, p90 {times[STEPS * 9 // 10] * 1e3:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
