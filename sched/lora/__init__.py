"""LoRA adapters: reading PEFT folders (adapter) and the scheduler's adapters and device slots (manager)."""
