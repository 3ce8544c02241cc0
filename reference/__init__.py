"""A small, readable, runnable implementation of Megatron-style tensor parallelism and FSDP.

Run the demo with `torchrun --nproc-per-node N -m reference --help`.
"""
