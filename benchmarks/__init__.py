"""Tandem's reproducible benchmarks, each run by one command and printing its table, the
command that made it, the commit, the machine and the date:

    python -m benchmarks decode       decode throughput against the HBM roofline
    python -m benchmarks serving      Tandem beside vLLM over HTTP, the same load generator
    python -m benchmarks first-token  where an idle server's first token goes
    python -m benchmarks prefill      time to first token of a burst of long prompts
    python -m benchmarks soak         mixed load with faults injected
    python -m benchmarks cpu          Tandem beside vLLM's CPU build

`docs/benchmarks.md` holds the current results. Shared parts: report.py (provenance, tables,
JSON), servers.py (server processes and load-generator runs), side_by_side.py (the comparison
driver), roofline.py (bytes and FLOPs).
"""
