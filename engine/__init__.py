"""The lockstep Qwen3 decode engine: torch + Triton model, KV cache, kernels, rank processes.

Importing this package imports nothing heavy: `lockstep check` imports the CLI modules of every
package at startup, and must not pay for (or require) torch. Import submodules explicitly.
"""
