"""Multi-LoRA serving: PEFT adapters (adapter.py), batched per-sequence compute (layers.py), device
slots with LRU eviction to host memory (manager.py), the engine's adapter names and load identities
(registry.py). See docs/runtime.md, "LoRA adapters"."""
