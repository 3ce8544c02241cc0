"""reference.measure.scale.meta_kernels: remembering a meta kernel's output metadata changes nothing a trace
sees, and never stands in for an op whose output aliases its input."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from reference.measure.scale import simulate
from reference.measure.scale.meta_kernels import SameShapes
from reference.measure.scale.shapes import setup_for


def _trace(setup, rank):
    """What the rank's trace holds but its clock: the events, the bytes held, the pipeline's peak."""
    held, pipeline = {}, {}
    events = simulate.trace_rank(setup, rank, held=held, pipeline=pipeline)
    return [dataclasses.replace(e, start=0, end=0) for e in events], held, pipeline


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2, sp=True), dict(tp=2, pp=1, dp=2, fsdp2=True)])
def test_a_trace_with_remembered_kernels_equals_one_without(monkeypatch, layout):
    setup = setup_for("small", microbatches=3 if layout["pp"] > 1 else 1, **layout)
    rank = simulate.default_ranks(setup)[-1]
    remembered = _trace(setup, rank)
    monkeypatch.setattr(simulate, "SameShapes", contextlib.nullcontext)
    assert remembered == _trace(setup, rank)


def test_views_and_in_place_ops_run_their_kernel_and_others_are_remembered():
    x = torch.empty(4, 6, device="meta")
    with SameShapes() as same:
        first, again = x.mul(2), x.mul(2)
        assert again is not first
        assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
        assert len(same._seen) == 1  # mul on the same metadata and scalar: one kernel run
        assert x.mul(3) is not None and len(same._seen) == 2  # another scalar is another key
        assert x.view(6, 4)._base is x  # a view stays a view of its input
        assert x.t().stride() == (1, 6)
        assert x.add_(1) is x  # in place: the input itself
        assert torch.cat([x, x]).shape == (8, 6)
