"""The load generator: TTFT, TPOT, ITL, latency and throughput over OpenAI HTTP or raw ZMQ.

``metrics`` (records and figures), ``workload`` (what to send), ``arrival`` (when), ``backends``
(how: openai-completions, openai-chat, zmq), ``runner`` (one run), ``sweep`` (several load
points and a plot), ``cli`` (flags; ``tandem bench`` and ``python -m loadgen``).
See docs/loadgen.md.
"""
