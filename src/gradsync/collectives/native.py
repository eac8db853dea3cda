"""The backend's own AllReduce (NCCL on GPU, Gloo on CPU), behind the same contract.

The transport makes the call (``backend_all_reduce``), so this module never
imports torch.distributed; the public layer upcasts fp16/bf16 around it.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.transport.base import PeerFailure


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place, with the backend's call.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    if flat.numel() == 0:
        return
    try:
        call.transport.backend_all_reduce(flat, call.remaining_s())
    except PeerFailure as failure:
        raise call.failure(failure, "backend all_reduce") from failure
