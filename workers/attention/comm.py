"""Ring point-to-point exchange over an explicitly passed CP process group.

Each `start` posts one async send of a tensor to the next rank of the ring and one receive from the
previous rank (batch_isend_irecv), and returns at once; `wait` blocks until both completed. Peers are
global ranks computed from the group, so no call ever touches the default group. On CUDA the P2P ops
are issued on a dedicated communication stream, and the compute stream waits for it only in `wait`.

One RingComm exists per ring and worker: the CP group's, and one per aligned CP subgroup the worker is
in (per-sequence CP degrees). AttentionRuntime.create builds them next to the groups
(workers/attention/runtime.py) and every attention call of that worker reuses them, comm streams included:
each ring has its own stream, so the rings of one micro-batch's different subgroups overlap on CUDA too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Pending:
    """An in-flight exchange: the receive buffer (valid after wait) and what must stay alive."""

    recv: torch.Tensor
    send: torch.Tensor
    works: list = field(default_factory=list)


class RingComm:
    """This rank's place in the ring of `group`: send to cp_rank + 1, receive from cp_rank - 1."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._stream: torch.cuda.Stream | None = None

    def _comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def start(self, send: torch.Tensor, tag: int = 0) -> Pending:
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, peer=self.next_peer, group=self.group, tag=tag),
            dist.P2POp(dist.irecv, recv, peer=self.prev_peer, group=self.group, tag=tag),
        ]
        if send.is_cuda:
            stream = self._comm_stream(send.device)
            stream.wait_stream(torch.cuda.current_stream(send.device))
            with torch.cuda.stream(stream):
                works = dist.batch_isend_irecv(ops)
        else:
            works = dist.batch_isend_irecv(ops)
        return Pending(recv=recv, send=send, works=works)

    def wait(self, pending: Pending) -> torch.Tensor:
        for work in pending.works:
            work.wait()
        if pending.recv.is_cuda:
            current = torch.cuda.current_stream(pending.recv.device)
            current.wait_stream(self._comm_stream(pending.recv.device))
            pending.recv.record_stream(current)
            pending.send.record_stream(current)
        return pending.recv
