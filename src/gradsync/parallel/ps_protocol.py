"""What the parameter server and its workers say to each other: fixed-layout headers and flat tensors.

No pickled objects cross the wire: every message is an int64 header of
``HEADER_NUMEL`` fields, optionally followed by one flat tensor: from the
server, the model's trainable parameters then its floating-point buffers of
the same dtype (BatchNorm statistics); from a worker, the gradients, then its
buffers (the server adopts the latest worker's, as DataParallel adopts rank
0's), then the micro-batch loss as one extra element. Each kind of message has its own tag,
so the server can receive headers from whichever worker sends first while
gradients and replies are matched per worker.

Worker -> server header: ``[kind, version_read, step, 0]``; kind is
``PULL`` (first contact, no payload) or ``PUSH`` (a gradient follows).
Server -> worker header: ``[kind, version, step, 0]``; kind is ``PARAMS``
(parameters follow; compute the gradient of ``step``) or ``STOP`` (no more
work; the final parameters follow, sent once every gradient is applied).
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.errors import CollectiveTimeoutError
from gradsync.transport.base import PeerFailure

HEADER_NUMEL = 4
PULL, PUSH = 1, 2
PARAMS, STOP = 1, 2
TAG_REQUEST, TAG_GRADIENT, TAG_REPLY, TAG_PARAMETERS = 101, 102, 103, 104


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_NUMEL, dtype=torch.int64)


def check_transport(comm) -> None:
    """The protocol needs tagged messages and a receive from any source (Gloo, or the thread transport).

    Raises:
        ValueError: the group's transport cannot carry it (NCCL matches neither tags nor any source).
    """
    transport = comm.transport
    if getattr(transport, "backend", None) == "nccl" or not hasattr(transport, "irecv_any"):
        raise ValueError("the parameter server needs a transport with tagged, any-source receives: "
                         "use gradsync.init(backend='gloo') (CPU tensors)")


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


def shared_buffers(module: nn.Module, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The buffers that travel with the parameters: floating point, of the parameters' dtype and device."""
    return [b for b in module.buffers() if b.dtype == params[0].dtype and b.device == params[0].device]


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


def check_layout(numel: int, peer_numel: int, peer: int, role: str) -> None:
    if numel != peer_numel:
        raise ValueError(f"{role}: worker rank {peer} has {peer_numel} trainable parameter and buffer elements, "
                         f"the server {numel}: the models differ")


def peer_error(failure: PeerFailure, what: str, rank: int, world_size: int, timeout_s: float,
               peer: int | None = None) -> CollectiveTimeoutError:
    """A :class:`CollectiveTimeoutError` naming the peer of a failed parameter-server exchange."""
    peer = failure.peer if peer is None else peer
    who = "an unknown peer" if peer < 0 else f"peer rank {peer}"
    return CollectiveTimeoutError(f"parameter server {what} on rank {rank} of {world_size}: {who} "
                                  f"{failure.reason} (timeout {timeout_s:g} s)",
                                  op=f"parameter_server.{what}", algorithm="parameter_server", rank=rank,
                                  peer=peer, step=what, timed_out=failure.timed_out)
