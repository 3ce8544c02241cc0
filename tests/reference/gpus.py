"""The devices the reference tests run on: CPU/gloo always, CUDA/NCCL (marked `cuda`, skipped without GPUs)."""

import pytest

# A collective claim needs two ranks, so its CUDA form needs two GPUs (one per rank); tests/ranks.py skips it with
# fewer. Where one rank means something (TP vs unsharded at TP 1), the test adds a world-1 CUDA form.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
