"""Tensor-parallel building blocks of the Qwen3 model, one concept per module."""
