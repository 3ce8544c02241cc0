"""A stopped or hung rank ends the job within the timeout, naming the rank.

A collective whose peer is stopped (SIGSTOP, a debugger, a lost node) waits in `Work::wait` while the peer's
sockets stay open, bounded only by its own group's timeout, and then fails without naming the peer. So each rank
stamps a counter in the rendezvous store (TCPStore, the same on gloo and NCCL, one node or many) every few
seconds from a daemon thread, and watches the next rank's counter; unchanged for `timeout_s` of its own clock
(no clocks compared across nodes), it prints one line and exits 1, and torchrun ends the other ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

EXIT_HUNG_PEER = 1
# torch's accessor of the rendezvous store is private, so it is looked up by feature: without it, no heartbeat.
_default_store = getattr(dist.distributed_c10d, "_get_default_store", None)


class Heartbeat:
    """start() after init_process_group; stop() right after the closing barrier, where every rank stops within
    moments of the others, so no watcher outlives its peer's stamps by anything near the timeout."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.interval_s = min(timeout_s / 10, 5.0)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.peer = (self.rank + 1) % world
        self.store = _default_store()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="reference-heartbeat", daemon=True)

    @staticmethod
    def possible() -> bool:
        return _default_store is not None

    @staticmethod
    def _key(rank: int) -> str:
        return f"reference/heartbeat/{rank}"

    def start(self) -> None:
        self.store.add(self._key(self.rank), 1)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        seen, changed_at = None, time.monotonic()
        while not self.stopping.wait(self.interval_s):
            self.store.add(self._key(self.rank), 1)
            beat = self.store.add(self._key(self.peer), 0)  # adding 0 reads a counter without waiting for it
            now = time.monotonic()
            if beat != seen:
                seen, changed_at = beat, now
            elif now - changed_at > self.timeout_s:
                print(
                    f"rank {self.peer} has not answered for {self.timeout_s:g} s (stopped or hung): ending this job",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_HUNG_PEER)  # the main thread may be blocked in a collective that never returns
