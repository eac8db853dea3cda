"""What the parameter server and its workers say to each other: fixed-layout headers and flat tensors.

No pickled objects cross the wire: every message is an int64 header of
``HEADER_NUMEL`` fields, optionally followed by one flat tensor: from the
server, its :class:`SharedModel` buffer (trainable parameters, floating-point
buffers such as BatchNorm statistics, frozen parameters); from a worker, the
gradients, then its buffers (the server adopts the latest worker's, as
DataParallel adopts rank 0's), then the micro-batch loss as one extra element. Each kind of message has its own tag,
so the server can receive headers from whichever worker sends first while
gradients and replies are matched per worker.

Worker -> server header: ``[PUSH, version_read, step, 0]`` (a gradient
follows) or, at first contact, ``[PULL, dtype code, shapes CRC, numel]``
(see :class:`SharedModel`; nothing follows).
Server -> worker header: ``[kind, version, step, 0]``; kind is ``PARAMS``
(parameters follow; compute the gradient of ``step``), ``STOP`` (no more
work; the final parameters follow, sent once every gradient is applied) or
``REJECT`` (the worker's model differs; nothing follows).

The elastic server (:mod:`~gradsync.elastic.ps_server`) adds a
sequence number in field 3 of a push (``[PUSH, version_read, step, seq]``),
``REPLAY`` (the same layout: a push the worker sent to an earlier membership
and keeps until it is durable; no reply), ``CHANGE`` (server -> worker: the
membership changes, leave it; nothing follows) and, in field 3 of ``PARAMS``
and ``STOP``, the highest sequence number of the worker's slot that the
server's newest checkpoint holds.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from gradsync.collectives.dtypes import OTHER_DTYPE_CODE, dtype_code, dtype_name
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError
from gradsync.transport.base import PeerFailure

HEADER_NUMEL = 4
PULL, PUSH, REPLAY = 1, 2, 3
PARAMS, STOP, REJECT, CHANGE = 1, 2, 3, 4
TAG_REQUEST, TAG_GRADIENT, TAG_REPLY, TAG_PARAMETERS = 101, 102, 103, 104


class MembershipChange(GradsyncError):
    """An elastic parameter server and its workers leave this membership (a worker died or joins, the
    server left): both sides go on in the next one, nothing lost."""


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_NUMEL, dtype=torch.int64)


def check_transport(comm) -> None:
    """The protocol needs tagged messages and a receive from any source (Gloo's default group, or threads).

    Raises:
        ValueError: NCCL (matches neither tags nor any source) or a torch
        subgroup (Gloo's any-source receive works on the default group only).
    """
    transport = comm.transport
    if getattr(transport, "backend", None) == "nccl" or not hasattr(transport, "irecv_any"):
        raise ValueError("the parameter server needs a transport with tagged, any-source receives: "
                         "use gradsync.init(backend='gloo') (CPU tensors)")
    if getattr(transport, "group", None) is not None:
        raise ValueError("the parameter server and its workers must use the default group (group=None): "
                         "Gloo receives from any source only there")


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the server owns, in registration order (shared ones once).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: no trainable parameters, or they differ in dtype or device.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"the parameter server needs one dtype and device for all trainable parameters, "
                         f"got {sorted(str(k) for k in kinds)}")
    if not params[0].dtype.is_floating_point:
        raise ValueError(f"parameters must be floating point, got {params[0].dtype}")
    return params


class SharedModel:
    """A module's tensors as the server and its workers share them: one flat buffer of views.

    Order: trainable parameters (``params_numel`` elements; their gradients
    are pushed), floating-point buffers of the same dtype and device
    (``buffers_numel``; pushed too: the server keeps the latest worker's),
    frozen parameters of that dtype (the server's are sent, never pushed).
    ``signature`` = (numel, dtype code, CRC of the shapes) is compared at a
    worker's first request, so models that differ fail before any payload moves.
    """

    def __init__(self, module: nn.Module):
        self.params = trainable_parameters(module)
        kind = (self.params[0].dtype, self.params[0].device)
        self.buffers = [b for b in module.buffers() if (b.dtype, b.device) == kind]
        frozen = [p for p in module.parameters() if not p.requires_grad and (p.dtype, p.device) == kind]
        tensors = self.params + self.buffers + frozen
        self.params_numel = sum(p.numel() for p in self.params)
        self.buffers_numel = sum(b.numel() for b in self.buffers)
        self.flat = flatten_into_views(tensors)
        shapes = ";".join(",".join(map(str, t.shape)) for t in tensors)
        self.signature = (self.flat.numel(), dtype_code(kind[0]), zlib.crc32(shapes.encode()))

    @property
    def push_numel(self) -> int:
        """Elements of a push: gradients, buffers, the loss."""
        return self.params_numel + self.buffers_numel + 1

    def check_peer(self, signature: list[int], peer: int) -> None:
        """Raise CollectiveMismatchError (a ValueError) naming ``peer`` and what differs, if its model's
        signature is not this one's."""
        names = ("numel of trainable parameters, buffers and frozen parameters", "dtype", "shapes")
        for name, mine, theirs in zip(names, self.signature, signature):
            if mine != theirs:
                if name == "dtype":
                    mine, theirs = (f"torch.{dtype_name(i)}" if i < OTHER_DTYPE_CODE else "other"
                                    for i in (mine, theirs))
                raise CollectiveMismatchError(f"parameter server: worker rank {peer}'s model differs from the server's: "
                                              f"{name} {theirs} != {mine}")


def flatten_into_views(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` into one flat buffer and make each a view of it (in place: ``.data``); returns it."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        view = flat[offset:offset + tensor.numel()].view_as(tensor)
        view.copy_(tensor.data)
        tensor.data = view
        offset += tensor.numel()
    return flat


def gather_gradients(params: list[nn.Parameter], out: torch.Tensor) -> None:
    """Copy every ``param.grad`` into ``out[:numel]`` (zeros where a parameter got no gradient)."""
    offset = 0
    for param in params:
        part = out[offset:offset + param.numel()]
        if param.grad is None:
            part.zero_()
        else:
            part.copy_(param.grad.reshape(-1))
        offset += param.numel()


def peer_error(failure: PeerFailure, what: str, rank: int, world_size: int, timeout_s: float,
               peer: int | None = None) -> CollectiveTimeoutError:
    """A :class:`CollectiveTimeoutError` naming the peer of a failed parameter-server exchange."""
    peer = failure.peer if peer is None else peer
    who = "an unknown peer" if peer < 0 else f"peer rank {peer}"
    return CollectiveTimeoutError(f"parameter server {what} on rank {rank} of {world_size}: {who} "
                                  f"{failure.reason} (timeout {timeout_s:g} s)",
                                  op=f"parameter_server.{what}", algorithm="parameter_server", rank=rank,
                                  peer=peer, step=what, timed_out=failure.timed_out)
