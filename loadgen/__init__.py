"""The load generator: TTFT, TPOT, ITL, latency and throughput over OpenAI HTTP or raw ZMQ.

``metrics`` (records and figures), ``workload`` (what to send), ``arrival`` (when), ``backends``
(how: openai-completions, openai-chat, zmq), ``runner`` (one run), ``sweep`` (several load
points and a plot), ``cli`` (flags; ``scripts/loadgen.py`` and ``tandem bench``).
See docs/loadgen.md.
"""
