"""LoRA adapters on the base model, many at once, mixed in one batch.

- ``adapter.py``: reads a PEFT folder (adapter_config.json + adapter_model.safetensors), checks
  every field that would change the output against what is implemented (peft's own LoraConfig
  reads the config), and lays the A/B matrices out for our fused q/k/v and gate/up projections,
  with the scale folded into B.
- ``layers.py``: the projections that carry LoRA slots (``LoraLinear``), and the product for a
  batch whose rows use different adapters: rows grouped by slot, ``x @ A.T @ B.T`` added to the
  base projection's output (a torch reference; a segment kernel can take its place on CUDA).
- ``manager.py``: adapters in host memory (LRU, loaded on a worker thread) and in a fixed number
  of slots on the device; the scheduler admits a request once its adapter holds a slot.

Why this shape: docs/design/lora.md.
"""
