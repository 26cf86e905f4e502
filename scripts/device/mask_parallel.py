"""How llguidance's parallel mask fill scales on the GPU machine (scripts/bench_structured.py's
records schema, 64 matchers advanced by the argmax of random logits)."""
import json, time, sys, os
import numpy as np, torch, llguidance, llguidance.torch as lt
from transformers import AutoTokenizer
sys.path.insert(0, "."); sys.path.insert(0, "scripts")
from engine_core.grammar import token_table, compile_matcher, allocate_bitmask
from protocol.messages import Constraint, ConstraintKind as K
from bench_structured import LONG_SCHEMAS
tok = AutoTokenizer.from_pretrained(os.environ["TANDEM_TOKENIZER_DIR"])
table = token_table(tok, 49152)
c = Constraint(K.JSON_SCHEMA, json.dumps(LONG_SCHEMAS["records"]))
tmpl = compile_matcher(c, table)
rows = 64
for threads, copies in ((1, True), (12, True), (1, False), (12, False)):
    ms = [tmpl.deep_copy() if copies else compile_matcher(c, table) for _ in range(rows)]
    rng = np.random.default_rng(0)
    bm = allocate_bitmask(rows, 49152)
    ex = llguidance.LLExecutor(num_threads=threads)
    ts = []
    for step in range(100):
        t=time.perf_counter(); lt.fill_next_token_bitmask_par(ex, [(x, j) for j, x in enumerate(ms)], bm); ts.append(time.perf_counter()-t)
        bits = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(rows, -1)[:, :49152].bool()
        logits = torch.from_numpy(rng.standard_normal((rows, 49152)).astype(np.float32)); logits[~bits] = -float("inf")
        for x, t_ in zip(ms, logits.argmax(-1).tolist()): assert x.consume_token(t_)
    kind = "deep copies of one template" if copies else "separately compiled"
    ts.sort(); print(f"threads {threads}, {kind}: 64-row fill median {ts[50]*1e3:.2f} ms p90 {ts[90]*1e3:.2f} ms", flush=True)
