"""Point-to-point transfers between adjacent pipeline stages: activations forward, their gradients backward.

Every micro-batch has the same shape and dtype, so the receiver allocates its buffer and no shape is exchanged.
Each call is one round of isend/irecv with one neighbour, even and odd stages issuing in opposite orders so that
the 1F1B steady state's combined send-forward/receive-backward cannot deadlock under NCCL. `RingP2P` carries the
interleaved schedule's transfers round a ring, `StageP2P` the zero-bubble schedules' to a named rank.

Mirrors
`megatron-lm:megatron/core/pipeline_parallel/p2p_communication.py::P2PCommunicator.send_forward_recv_backward`
and its siblings, ordered as `megatron-lm:megatron/core/pipeline_parallel/p2p_communication.py::_p2p_ops`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _FixedShapeP2P:
    """What both transfer schemes share: the PP group, and the one activation shape, dtype and device every
    receive buffer is allocated with (no shape is exchanged)."""

    def __init__(self, pp_group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.group, self.shape, self.dtype, self.device = pp_group, tuple(shape), dtype, device
        self.rank, self.size = pp_group.rank(), pp_group.size()

    def _peer(self, pp_rank: int) -> int:
        """The global rank of stage `pp_rank` (taken round the ring)."""
        return dist.get_global_rank(self.group, pp_rank % self.size)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


class PipelineP2P(_FixedShapeP2P):
    """The four transfers of one stage; at the pipeline's ends the missing neighbour's transfers are no-ops
    (receives return None)."""

    def __init__(self, pp_group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__(pp_group, shape, dtype, device)
        self.is_first, self.is_last, self.even = self.rank == 0, self.rank == self.size - 1, self.rank % 2 == 0
        self.prev = None if self.is_first else self._peer(self.rank - 1)
        self.next = None if self.is_last else self._peer(self.rank + 1)

    def _communicate(
        self,
        *,
        send_next=None,
        send_prev=None,
        recv_prev=False,
        recv_next=False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One round; returns (tensor from prev, tensor from next). Received activations require grad.

        Mirrors `megatron-lm:megatron/core/pipeline_parallel/p2p_communication.py::_p2p_ops`.
        """
        from_prev = self._buffer() if recv_prev and self.prev is not None else None
        from_next = self._buffer() if recv_next and self.next is not None else None
        ops = {
            "send_next": (dist.isend, send_next if self.next is not None else None, self.next),
            "recv_prev": (dist.irecv, from_prev, self.prev),
            "send_prev": (dist.isend, send_prev if self.prev is not None else None, self.prev),
            "recv_next": (dist.irecv, from_next, self.next),
        }
        order = (
            ("send_next", "recv_prev", "send_prev", "recv_next")
            if self.even
            else ("recv_prev", "send_next", "recv_next", "send_prev")
        )
        works = [
            op(tensor.contiguous() if op is dist.isend else tensor, peer, group=self.group)
            for op, tensor, peer in (ops[name] for name in order)
            if tensor is not None
        ]
        for work in works:
            work.wait()
        if from_prev is not None:
            from_prev.requires_grad_()
        return from_prev, from_next

    def recv_forward(self) -> torch.Tensor | None:
        return self._communicate(recv_prev=True)[0]

    def send_forward(self, output: torch.Tensor) -> None:
        self._communicate(send_next=output.detach())

    def recv_backward(self) -> torch.Tensor | None:
        return self._communicate(recv_next=True)[1]

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self._communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        """1F1B steady state: the output of this forward goes on, the gradient of an older one comes back.

        Mirrors
        `megatron-lm:megatron/core/pipeline_parallel/p2p_communication.py::P2PCommunicator.send_forward_recv_backward`.
        """
        return self._communicate(send_next=output.detach(), recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._communicate(send_prev=input_grad, recv_prev=True)[0]


class RingP2P(_FixedShapeP2P):
    """Transfers of one stage under interleaving, where the last stage's chunk c feeds the first stage's chunk
    c + 1, so the neighbours wrap round a ring. Sends are posted at once (isend) and waited in `wait_sends`;
    a receive blocks until its tensor is there. Any order of actions that respects the data dependencies then
    runs without deadlock, as long as a pair's messages in one direction arrive in the order they are used:
    each direction has its own tag (at p = 2 the same neighbour is both next and previous), and within a
    direction both ends walk the same schedule table. That holds for gloo, which matches by tag and completes
    sends independently (the CPU suite runs it). NCCL ignores tags and runs one communicator's transfers in
    issue order on one stream, which this scheme does not arrange for; megatron/core/pipeline_parallel/
    schedules.py::forward_backward_pipelining_with_interleaving instead exchanges in matched batched rounds.
    The interleaved schedule is not run on CUDA here (it needs p >= 2 GPUs)."""

    FORWARD, BACKWARD = 0, 1  # tags: activations go to next, their gradients to prev

    def __init__(self, pp_group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__(pp_group, shape, dtype, device)
        self.prev, self.next = self._peer(self.rank - 1), self._peer(self.rank + 1)
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # the tensor stays alive until sent

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, peer, group=self.group, tag=tag), tensor))

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        buffer = self._buffer()
        dist.irecv(buffer, peer, group=self.group, tag=tag).wait()
        return buffer

    def send_forward(self, output: torch.Tensor) -> None:
        self._send(output, self.next, self.FORWARD)

    def recv_forward(self) -> torch.Tensor:
        """The input activation of this stage's next forward that needs one; it requires grad."""
        return self._recv(self.prev, self.FORWARD).requires_grad_()

    def send_backward(self, input_grad: torch.Tensor) -> None:
        self._send(input_grad, self.prev, self.BACKWARD)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.next, self.BACKWARD)

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class StageP2P(RingP2P):
    """Transfers of the zero-bubble schedules, to a named PP rank (the ranks of the stage before and after),
    in RingP2P's scheme: sends posted at once, receives blocking, one tag per kind. In a V (rank r holds stages
    r and 2p - 1 - r) activations also travel to the previous rank; between two ranks each tag then still
    carries one stream, in the order of its micro-batches: to the next rank go the down leg's activations and
    the back leg's gradients, to the previous rank the back leg's activations and the down leg's gradients.
    Like RingP2P's, the scheme relies on gloo matching by tag; it is not arranged for NCCL."""

    def send_activation(self, output: torch.Tensor, pp_rank: int) -> None:
        self._send(output, self._peer(pp_rank), self.FORWARD)

    def recv_activation(self, pp_rank: int) -> torch.Tensor:
        return self._recv(self._peer(pp_rank), self.FORWARD).requires_grad_()

    def send_gradient(self, input_grad: torch.Tensor, pp_rank: int) -> None:
        self._send(input_grad, self._peer(pp_rank), self.BACKWARD)

    def recv_gradient(self, pp_rank: int) -> torch.Tensor:
        return self._recv(self._peer(pp_rank), self.BACKWARD)
