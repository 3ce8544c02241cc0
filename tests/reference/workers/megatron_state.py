"""megatron-core's global parallel state for the span of a `with` block, for the workers that run megatron.

megatron's layers, optimizers and schedules read their process groups from `megatron.core.parallel_state`;
each run sets it up for its own sizes and tears it down after, so the next run (or the next worker of a shared
launch, workers/shared_worker.py) starts from none: megatron's groups forgotten (also when a check raises), and
torch's destroyed (common.groups_of_the_block; not after a raise, when the rank is going down).
"""

import contextlib

from common import groups_of_the_block
from megatron.core import parallel_state


@contextlib.contextmanager
def megatron_parallel_state(**sizes):
    """`initialize_model_parallel(**sizes)` for the body, without its extra gloo groups (no run here uses
    them), then `destroy_model_parallel()` and every group it made destroyed."""
    with groups_of_the_block():
        parallel_state.initialize_model_parallel(**sizes, create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
