"""Multi-LoRA serving: PEFT adapters (adapter.py), batched per-sequence compute (layers.py), device
slots with LRU eviction to host memory (manager.py). See docs/runtime.md, "LoRA adapters"."""
