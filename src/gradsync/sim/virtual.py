"""Tensors without data: what the real algorithms slice, add and copy in a simulation.

A :class:`VirtualTensor` has a shape, a dtype and a place in a root buffer,
and nothing else. The algorithms of :mod:`gradsync.collectives` index it,
view it and add into it exactly as they do a real tensor; every add or copy
charges its time to the rank that runs it (``cluster.compute``), so the cost
of the reductions comes from the real code's own additions, not from a
count kept beside it. Torch's meta tensors would do the same at about ten
times the cost per slice, which a 4096-rank run cannot afford.

>>> from gradsync.sim.virtual import VirtualTensor
>>> t = VirtualTensor.empty(10, torch.float32)
>>> t[2:6].numel(), t[2:6].offset, t.view(2, 5)[1, :3].offset
(4, 2, 5)
"""

from __future__ import annotations

import math

import torch

_META = torch.device("meta")


class VirtualTensor:
    """A contiguous view of ``shape`` into a root buffer, starting ``offset`` elements in.

    Supports what the collectives use: ``numel``, ``element_size``, ``dtype``,
    ``device``, ``shape``, ``view``/``reshape``, indexing by ints and slices
    (step 1), iteration over the first dimension, ``+=``/``add_``, ``copy_``,
    ``div_``/``mul_``, ``is_contiguous``, ``contiguous``.
    """

    __slots__ = ("shape", "dtype", "offset", "root", "cluster", "device", "_numel")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0, root: int = 0,
                 cluster=None, device: torch.device = _META):
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self._numel = shape[0] if len(shape) == 1 else math.prod(self.shape)
        self.dtype = dtype
        self.offset = offset
        self.root = root
        self.cluster = cluster
        self.device = device

    @classmethod
    def empty(cls, numel: int, dtype: torch.dtype, cluster=None, root: int = 0,
              device: torch.device = _META) -> "VirtualTensor":
        return cls((numel,), dtype, 0, root, cluster, device)

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self._numel * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def is_contiguous(self) -> bool:
        return True

    def contiguous(self) -> "VirtualTensor":
        return self

    def _like(self, shape, offset: int) -> "VirtualTensor":
        return VirtualTensor(shape, self.dtype, offset, self.root, self.cluster, self.device)

    def view(self, *shape) -> "VirtualTensor":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        numel = self.numel()
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(numel // known if d == -1 else d for d in shape)
        if math.prod(shape) != numel:
            raise RuntimeError(f"shape {list(shape)} is invalid for input of size {numel}")
        return self._like(shape, self.offset)

    reshape = view

    def __getitem__(self, key) -> "VirtualTensor":
        if type(key) is slice and len(self.shape) == 1 and key.step is None:  # the common case, fast
            start, stop, _ = key.indices(self.shape[0])
            return VirtualTensor((max(stop - start, 0),), self.dtype, self.offset + start, self.root,
                                 self.cluster, self.device)
        keys = key if isinstance(key, tuple) else (key,)
        shape, offset = self.shape, self.offset
        stride = self._numel
        out_shape = []
        for dim, item in enumerate(keys):
            size = shape[dim]
            stride = stride // size if size else 0
            if type(item) is slice:
                start, stop, step = item.indices(size)
                if step != 1:
                    raise NotImplementedError("a virtual tensor takes slices of step 1 only")
                offset += start * stride
                out_shape.append(max(stop - start, 0))
            else:
                index = item + size if item < 0 else item
                if not 0 <= index < size:
                    raise IndexError(f"index {item} is out of bounds for dimension {dim} with size {size}")
                offset += index * stride
        out_shape.extend(shape[len(keys):])
        return self._like(tuple(out_shape), offset)

    def __setitem__(self, key, value) -> None:
        target = self[key]
        if isinstance(value, VirtualTensor) and (value.root, value.offset, value.shape) == \
                (target.root, target.offset, target.shape):
            return  # ``x[a:b] += y`` writes the view back onto itself: torch's copy_ skips that too
        target.copy_(value)

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        return (self[index] for index in range(self.shape[0]))

    def _charge(self, kind: str) -> None:
        if self.cluster is not None:
            self.cluster.compute(kind, self)

    def __iadd__(self, other) -> "VirtualTensor":
        self._charge("reduce")
        return self

    def add_(self, other, alpha=1) -> "VirtualTensor":
        self._charge("reduce")
        return self

    def copy_(self, other) -> "VirtualTensor":
        self._charge("copy")
        return self

    def div_(self, other) -> "VirtualTensor":
        self._charge("scale")
        return self

    mul_ = div_

    def __repr__(self) -> str:
        return (f"VirtualTensor(shape={tuple(self.shape)}, dtype={self.dtype}, offset={self.offset}, "
                f"root={self.root})")


class VirtualWorkspace:
    """The :class:`~gradsync.collectives.call.Workspace` of a simulated rank: buffers without memory.

    Each ``get`` returns a new root (an id of its own), so a trace tells a
    received segment's scratch buffer from the message itself (root 0).
    """

    def __init__(self, cluster, device: torch.device = _META):
        self._cluster = cluster
        self._device = device
        self._roots = 0

    def get(self, numel: int, dtype: torch.dtype, device=None, purpose: str = "recv") -> VirtualTensor:
        self._roots += 1
        return VirtualTensor.empty(numel, dtype, self._cluster, root=self._roots, device=self._device)
