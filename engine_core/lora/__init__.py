"""LoRA adapters on the base model, many at once, mixed in one batch.

- ``adapter.py``: reads a PEFT folder (adapter_config.json + adapter_model.safetensors), checks
  every field that would change the output against what is implemented (peft's own LoraConfig
  reads the config), and lays the A/B matrices out for our fused q/k/v and gate/up projections
  and an MoE layer's stacked experts, with the scale folded into B.
- ``batch.py``: a step's rows by adapter slot (groups for the torch form, a tile table for the
  kernels, which CUDA graphs read from a static buffer).
- ``layers.py``: the projections and MoE layers that carry LoRA slots (``LoraLinear``,
  ``LoraExperts``), and the product for a batch whose rows use different adapters, in torch.
- ``triton_lora.py``: the tile kernels that replace the torch product on CUDA, graph-safe.
- ``triton_moe.py``: the MoE experts' LoRA kernels over the fused MoE's row blocks, graph-safe.
- ``manager.py``: adapters in host memory (LRU, read on a worker thread) and in a fixed number
  of slots on the device; the scheduler admits a request once its adapter holds a slot.

Why this shape: docs/design/lora.md.
"""
