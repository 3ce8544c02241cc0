"""A stopped rank ends the job, in one line naming it, within the timeout (reference.heartbeat).

A real torchrun job: rank 1 SIGSTOPs itself mid-step, so its sockets stay open and rank 0 waits in a
collective; before the heartbeat rank 0 waited out the TP group's own timeout (torch's 30 min default)."""

import re
import time

from tests.launch import CRASHES, torchrun_failing

TIMEOUT_S = 4
# torchrun SIGTERMs the other ranks when one fails; a stopped rank cannot act on it, so torchrun SIGKILLs it
# after a grace period fixed at 30 s (torch.distributed.elastic's close() as its monitor calls it).
TORCHRUN_GRACE_S = 30
SLACK_S = 6  # the heartbeat's interval (timeout / 10) twice, torchrun's polling, a loaded machine


def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_the_rank():
    limit = TIMEOUT_S + TORCHRUN_GRACE_S + SLACK_S
    message, _ = torchrun_failing(
        CRASHES / "hung_rank.py", 2, timeout=limit + 15, env={"REFERENCE_TIMEOUT_S": str(TIMEOUT_S)}
    )
    ended = time.time()
    stopped = float(re.search(r"rank 1 stops at (\S+)", message).group(1))
    line = rf"^rank 1 has not answered for {TIMEOUT_S} s \(stopped or hung\): ending this job$"
    assert re.search(line, message, re.M), message[-2000:]
    assert TIMEOUT_S + TORCHRUN_GRACE_S <= ended - stopped <= limit, message[-2000:]
    assert "unreachable on rank 0" not in message
