"""Bad input to the TP reference, at world 2: each case's ParallelConfigError message (or that none was
raised) per rank, for test_tp_bad_input.py to check it names the problem in one line, identically everywhere."""

import torch
import torch.distributed as dist
from common import serve

from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer, init_method_normal


def error_of(make) -> str | None:
    """The ParallelConfigError message `make()` raises; None when it raises none."""
    try:
        make()
    except ParallelConfigError as error:
        return str(error)
    return None


def results(device: torch.device) -> dict:
    """Each case's error message on this rank, and the shape the padded model returns."""
    tp = build_layout(tp_size=2).tp_group

    def column(**kw):
        return ColumnParallelLinear(8, 8, tp_group=tp, init_method=init_method_normal(), device=device, **kw)

    model = parallelize(Transformer(1, 8, 2, device=device), tp, sequence_parallel=True)
    cases = {
        "tp_3": lambda: build_layout(tp_size=3),
        "heads_3": lambda: parallelize(Transformer(1, 12, 3), tp),
        "hidden_18": lambda: parallelize(Transformer(1, 18, 4), tp),
        "column_output_7": lambda: ColumnParallelLinear(8, 7, tp_group=tp, init_method=init_method_normal()),
        "row_input_7": lambda: RowParallelLinear(7, 8, tp_group=tp, init_method=init_method_normal()),
        "row_sp_input_not_parallel": lambda: RowParallelLinear(
            8, 8, tp_group=tp, init_method=init_method_normal(), sequence_parallel=True
        ),
        "float64_input": lambda: column()(torch.ones(4, 2, 8, dtype=torch.float64, device=device)),
        "meta_input": lambda: column()(torch.ones(4, 2, 8, device="meta")),
        "last_dimension_6": lambda: column()(torch.ones(4, 2, 6, device=device)),
        "sequence_5": lambda: model(torch.ones(5, 1, 8, device=device)),
        "split_twice": lambda: parallelize(model, tp),
    }
    errors = {name: error_of(make) for name, make in cases.items()}
    # the same model with padding by request runs and keeps the sequence length
    padded = parallelize(Transformer(1, 8, 2, device=device), tp, sequence_parallel=True, pad_sequence=True)
    return {
        "errors": errors,
        "padded_output_shape": list(padded(torch.ones(5, 1, 8, device=device)).shape),
        "rank": dist.get_rank(),
    }


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
