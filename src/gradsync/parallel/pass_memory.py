"""One measured forward and backward of a sample micro-batch: the bytes it holds at its peak, gradients apart.

:func:`measure_pass` runs ``loss_fn(module(*inputs)).backward()`` once under a
``TorchDispatchMode`` that sees every tensor each operator returns, in the
forward and in the backward: a storage is counted from the operator that
made it until it is freed (a weak reference to the storage says when), each
storage once however many views it has. What existed before the pass (the
parameters, buffers and inputs) is not counted. So the count holds what
autograd saves for backward, the forward's outputs and the backward's
temporaries (each operator's outputs, e.g. the gradient of every
activation and the softmax's backward), measured at every operator's end;
scratch memory an operator frees before it returns (a kernel's internal
workspace) is not seen.

Gradients are kept apart: a ``post_accumulate_grad`` hook on each parameter
says when its ``.grad`` is set, and from then on that storage counts as a
gradient, not as an activation, so that each sharding level can charge
gradients by its own rule (kept whole, copied into a bucket and released,
reduce-scattered per bucket). The parameters are detached copies of the
module's (sharing their storage, with ``torch.func.functional_call``), so a
``DataParallel``'s gradient hooks on the real ones never fire.

The pass also runs on the process's real allocator, so it is measured a
second way: the resident memory it took (the peak of the resident set, or
of the CUDA caching allocator's reserved bytes, above where it started).
What that exceeds the tensors by is the allocator's own: glibc's heap keeps
freed blocks for reuse and cannot always reuse them for the next sizes
asked (a block freed inside the heap is not given back, and its dynamic
mmap threshold sends a size to the heap once a chunk that large was freed),
and torch's CUDA allocator rounds and caches blocks. The heap is trimmed
first (:func:`gradsync.hosts.resident.trim_heap`), so the pass starts from
what it would start from in a run that trims before it.

Like PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``
(operator outputs by storage, weak references for frees), reduced to the
one number per gradient count that the preflight needs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradsync.hosts import resident


@dataclass(frozen=True)
class PassMemory:
    """What one forward and backward held beyond the module's tensors and the inputs, in bytes.

    ``peak_by_ready[k]``: the most held (activations, temporaries, gradients not yet accumulated) while
    exactly ``k`` parameters had their ``.grad`` set, those ``k`` gradients not included;
    ``ready_order``: trainable parameter indices (``module.parameters()`` order, frozen ones skipped) in
    the order their ``.grad`` was set; ``grad_bytes[i]``: bytes of parameter ``i``'s gradient;
    ``resident_bytes``: the resident memory the pass took (None where it cannot be read).
    """

    peak_by_ready: tuple[int, ...]
    ready_order: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    resident_bytes: int | None = None

    def peak(self, held_gradients=lambda ready: 0) -> int:
        """The pass's peak when ``held_gradients(k)`` bytes of gradients are held once ``k`` are ready."""
        return max(peak + held_gradients(ready) for ready, peak in enumerate(self.peak_by_ready))

    def as_run(self) -> int:
        """The peak of the pass as it ran: every gradient kept from when it was set."""
        held = [0]
        for index in self.ready_order:
            held.append(held[-1] + self.grad_bytes[index])
        return self.peak(lambda ready: held[min(ready, len(held) - 1)])

    def allocator_bytes(self) -> int:
        """What the allocator held beyond the pass's tensors at its peak (0 when not measured)."""
        return 0 if self.resident_bytes is None else max(self.resident_bytes - self.as_run(), 0)


def scaled(small: PassMemory, large: PassMemory, small_size: int, large_size: int, size: int) -> PassMemory:
    """The pass at a micro-batch of ``size`` samples, extrapolated linearly from two measured at
    ``small_size`` < ``large_size`` (what a pass holds is an affine function of its samples: the
    activations grow with them, the weights' gradients and temporaries do not), per gradient count; the
    allocator's part is not extrapolated (None).

    Raises:
        ValueError: the two passes set their gradients in different orders, or the sizes are not increasing.
    """
    if small.ready_order != large.ready_order or not 0 < small_size < large_size:
        raise ValueError("scaled() needs two passes of the same module, at increasing micro-batch sizes")
    slope = [(big - little) / (large_size - small_size) for little, big in zip(small.peak_by_ready,
                                                                             large.peak_by_ready)]
    peaks = tuple(max(int(round(little + rate * (size - small_size))), 0)
                  for little, rate in zip(small.peak_by_ready, slope))
    return PassMemory(peaks, large.ready_order, large.grad_bytes)


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages operators made that are still alive, the gradients' apart."""

    def __init__(self, known: set[int], ready_count: int):
        super().__init__()
        self.known = known
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.gradients = 0
        self.gradient_keys: set[int] = set()
        self.ready = 0
        self.peak_by_ready = [0] * (ready_count + 1)

    def _freed(self, key: int, nbytes: int):
        def callback(_):
            self.live -= nbytes
            self.refs.pop(key, None)
        return callback

    def note(self) -> None:
        held = self.live - self.gradients
        self.peak_by_ready[self.ready] = max(self.peak_by_ready[self.ready], held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.known and key not in self.refs:
                    nbytes = storage.nbytes()
                    self.refs[key] = weakref.ref(storage, self._freed(key, nbytes))
                    self.live += nbytes
        self.note()
        return out

    def gradient_set(self, grad: torch.Tensor) -> None:
        """A parameter's ``.grad`` was set: its storage counts as a gradient from now on."""
        key = grad.untyped_storage().data_ptr()
        if key in self.refs and key not in self.gradient_keys:
            self.gradient_keys.add(key)
            self.gradients += grad.untyped_storage().nbytes()
        self.ready += 1
        self.note()


def _flat_tensors(value) -> list[torch.Tensor]:
    return [item for item in tree_flatten(value)[0] if isinstance(item, torch.Tensor)]


def _default_loss(output) -> torch.Tensor:
    """The sum of every floating-point output: a scalar whose backward reaches every parameter used."""
    parts = [tensor.sum() for tensor in _flat_tensors(output) if tensor.is_floating_point()]
    if not parts:
        raise ValueError("the module's output holds no floating-point tensor to take a backward of; pass loss_fn")
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def measure_pass(module: nn.Module, sample_batch, loss_fn=None) -> PassMemory:
    """Run one forward of ``sample_batch`` (a tensor, or a tuple/list of the forward's arguments), the
    loss (``loss_fn(output)``, a scalar; None: the sum of the floating-point outputs) and its backward,
    counting what they hold (:class:`PassMemory`). The module's parameters and their ``.grad`` are
    left as they were. Under ``torch.no_grad()`` (an evaluation) there is no backward, and ``loss_fn``
    may return anything (what scoring the output computes).

    Raises:
        ValueError: no floating-point output to take the default loss of.
    """
    _load_code()
    inputs = tuple(sample_batch) if isinstance(sample_batch, (tuple, list)) else (sample_batch,)
    named = list(module.named_parameters())
    trainable = [(name, param) for name, param in named if param.requires_grad]
    leaves = {name: param.detach().requires_grad_(param.requires_grad) for name, param in named}
    known = {tensor.untyped_storage().data_ptr() for tensor in
             [*(param for _, param in named), *module.buffers(), *_flat_tensors(inputs)]}
    mode = _LiveStorages(known, len(trainable))
    device = next((p.device for _, p in named if p.device.type == "cuda"), None)
    start = _resident_start(device)
    order: list[int] = []
    handles = []
    for index, (name, _) in enumerate(trainable):
        def hook(leaf, index=index):
            order.append(index)
            mode.gradient_set(leaf.grad)
        handles.append(leaves[name].register_post_accumulate_grad_hook(hook))
    try:
        with mode:
            loss = (loss_fn or _default_loss)(torch.func.functional_call(module, leaves, inputs))
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
            del loss
    finally:
        for handle in handles:
            handle.remove()
    grad_bytes = tuple(param.numel() * param.element_size() for _, param in trainable)
    return PassMemory(tuple(mode.peak_by_ready), tuple(order), grad_bytes, _resident_taken(device, start))


_LOADED = []


def _load_code() -> None:
    """Run a one-element pass once per process before any measured one, so that the code it loads
    (``torch.func``'s modules, ~70 MiB of Python objects on first use) is not counted as a pass's memory."""
    if not _LOADED:
        _LOADED.append(True)
        probe = nn.Linear(1, 1)
        with _LiveStorages(set(), 0), torch.enable_grad():
            leaves = {name: param.detach().requires_grad_() for name, param in probe.named_parameters()}
            torch.func.functional_call(probe, leaves, (torch.zeros(1, 1),)).sum().backward()


def _resident_start(device) -> int | None:
    """Where the resident count stands before the pass, its peak reset (None: it cannot be reset). On the
    CPU the heap's free blocks are given back first (``malloc_trim``), so that what the pass takes is its
    own and not what earlier work left free: ``gradsync train`` gives them back before each evaluation too."""
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_reserved(device)
    resident.trim_heap()
    return resident.resident_bytes() if resident.reset_peak() else None


def _resident_taken(device, start: int | None) -> int | None:
    if start is None:
        return None
    if device is not None:
        return max(torch.cuda.max_memory_reserved(device) - start, 0)
    return max(resident.peak_resident_bytes(since_reset=True) - start, 0)
