"""A stopped rank ends the job, in one line naming it, within the timeout (reference.heartbeat).

A real torchrun job: rank 1 SIGSTOPs itself mid-step, so its sockets stay open and rank 0 waits in a
collective; before the heartbeat rank 0 waited out the TP group's own timeout (torch's 30 min default)."""

import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from reference.distributed import TIMEOUT_ENV, LaunchError, timeout_from_env
from reference.heartbeat import Heartbeat
from tests.launch import CRASHES, torchrun_failing
from tests.ranks import on_ranks

TIMEOUT_S = 4


def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_the_rank():
    """Without the heartbeat rank 0 would wait out the TP group's 30 min: the launch's bound (300 s, generous for
    a loaded machine; a run still going then fails the test as hung) tells the two apart without timing the job.
    torchrun itself waits 30 s (torch.distributed.elastic's close()) before it SIGKILLs the stopped rank."""
    message, _ = torchrun_failing(CRASHES / "hung_rank.py", 2, timeout=300, env={"REFERENCE_TIMEOUT_S": str(TIMEOUT_S)})
    assert "rank 1 stops at" in message, message[-2000:]
    line = rf"^rank 1 has not answered for {TIMEOUT_S} s \(stopped or hung\): ending this job$"
    assert re.search(line, message, re.M), message[-2000:]
    assert "unreachable on rank 0" not in message


@on_ranks(2, timeout_s=2)
def test_ranks_busy_past_the_timeout_but_alive_are_not_ended_and_the_heartbeat_stops_with_its_group(ranks):
    """The heartbeat runs while the group lives; it answers from its own thread, so a rank busy in an op that
    releases the GIL (a sleep, a long kernel) for longer than the timeout is not taken for a hung one."""
    assert [t.name for t in threading.enumerate()].count("reference-heartbeat") == 1
    time.sleep(3 * 2)
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2
    extra = Heartbeat(timeout_s=2)
    extra.start()
    extra.stop()
    assert not extra.thread.is_alive()
    assert [t.name for t in threading.enumerate()].count("reference-heartbeat") == 1


@pytest.mark.parametrize("text", ["0", "-3", "nan", "inf", "ten"])
def test_a_timeout_from_the_environment_that_is_not_a_positive_number_is_refused_in_one_line(monkeypatch, text):
    monkeypatch.setenv(TIMEOUT_ENV, text)
    with pytest.raises(LaunchError, match=rf"^{TIMEOUT_ENV}='{text}': expected a positive, finite number"):
        timeout_from_env(120)


def test_the_timeout_from_the_environment_replaces_the_callers(monkeypatch):
    assert timeout_from_env(120) == 120
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert timeout_from_env(120) == 7.5
