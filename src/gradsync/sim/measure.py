"""Time a model's forward, backward (each gradient's moment) and SGD step on one process here.

What :func:`measure_compute` returns is the compute input of
``gradsync simulate train`` on the ``this-machine`` profile: measured on one
unwrapped module (no communication), never fitted to a training run.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.sim.compute import StepCompute


def measure_compute(module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, threads: int,
                    steps: int = 20, warmup: int = 3, lr: float = 0.01) -> StepCompute:
    """Medians over ``steps`` SGD steps of ``module`` on one batch (after ``warmup``), in ``threads`` threads.

    A step is what ``gradsync bench train`` runs: ``zero_grad(set_to_none=True)``, forward,
    cross-entropy, backward, ``SGD.step``. ``ready_s[i]``: from backward's start to parameter i's
    post-accumulate-grad hook.

    Raises:
        ValueError: ``threads``, ``steps`` < 1 or ``warmup`` < 0.
    """
    if threads < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need threads >= 1, steps >= 1, warmup >= 0; got {threads}, {steps}, {warmup}")
    params = [p for p in module.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    stamps: list[float] = [0.0] * len(params)

    def hook(param: torch.Tensor) -> None:
        stamps[index[id(param)]] = time.perf_counter()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    optimizer = torch.optim.SGD(params, lr=lr)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    forwards, backwards, steps_s, ready = [], [], [], []
    try:
        for step in range(warmup + steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(module(inputs), labels)
            backward_from = time.perf_counter()
            loss.backward()
            backward_to = time.perf_counter()
            optimizer.step()
            ended = time.perf_counter()
            if step >= warmup:
                forwards.append(backward_from - started)
                backwards.append(backward_to - backward_from)
                steps_s.append(ended - backward_to)
                ready.append([stamp - backward_from for stamp in stamps])
    finally:
        torch.set_num_threads(before)
        for handle in handles:
            handle.remove()
    backward_s = statistics.median(backwards)
    ready_s = tuple(min(statistics.median(r[i] for r in ready), backward_s) for i in range(len(params)))
    return StepCompute(tuple(p.detach() for p in params), statistics.median(forwards), backward_s, ready_s,
                       statistics.median(steps_s), f"measured here: {threads} thread(s), median of {steps} steps")
