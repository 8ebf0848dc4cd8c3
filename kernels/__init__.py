"""Compute kernels: attention backends and the small layers (norm, rotary,
activation), the multi-LoRA GEMMs. One dispatch point per op picks CPU (pure torch) or GPU code.
Imports nothing of the rest of sgl."""
