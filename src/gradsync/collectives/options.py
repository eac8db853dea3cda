"""Per-algorithm settings held by a communicator, looked up by type.

Each algorithm defines its settings as one options class in its own module
(``SegmentOptions`` in :mod:`~gradsync.collectives.chunking`,
``HierarchicalOptions`` in :mod:`~gradsync.collectives.hierarchical`,
``ShmState`` in :mod:`~gradsync.collectives.shm`). The communicator keeps the
instances it was given in an :class:`OptionStore` and never imports the
algorithm modules: an algorithm asks ``call.options(HierarchicalOptions)``
and gets the communicator's instance, or a default-constructed one made on
first use and kept (so stateful ones, like the shared-memory segment, live
as long as the communicator). This is Gloo's context: the group sits below
the algorithms.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def check_count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``.

    Raises:
        TypeError: not an integer (a bool, float or string is refused, not rounded);
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


class AlgorithmOptions:
    """Base of the options classes: construction checks what it can, :meth:`check` the rest.

    Subclasses must be constructible with no arguments (the defaults).
    """

    def check(self, world_size: int) -> None:
        """Raise ValueError if these options cannot serve a group of ``world_size`` ranks."""

    def close(self) -> None:
        """Release what the options hold (shared memory, ...); a no-op for plain settings."""


class OptionStore:
    """Options instances keyed by their type; a child store overrides some and defers to its parent.

    Raises:
        ValueError: two instances of one type given; TypeError: an entry is not an AlgorithmOptions.
    """

    def __init__(self, options=(), parent: "OptionStore | None" = None):
        self._own: dict[type, AlgorithmOptions] = {}
        self._parent = parent
        for option in options:
            if not isinstance(option, AlgorithmOptions):
                raise TypeError(f"options must be AlgorithmOptions instances (e.g. SegmentOptions, "
                                f"HierarchicalOptions), got {type(option).__name__}")
            if type(option) in self._own:
                raise ValueError(f"options holds two {type(option).__name__} instances; pass one")
            self._own[type(option)] = option

    def get(self, kind: type[T]) -> T:
        """The instance of ``kind`` here or in a parent; else a default one, kept in the root store."""
        if not (isinstance(kind, type) and issubclass(kind, AlgorithmOptions)):
            raise TypeError(f"options are looked up by an AlgorithmOptions subclass, got {kind!r}")
        store = self
        while store is not None:
            if kind in store._own:
                return store._own[kind]
            store = store._parent
        root = self
        while root._parent is not None:
            root = root._parent
        return root._own.setdefault(kind, kind())

    def check(self, world_size: int) -> None:
        for option in self._own.values():
            option.check(world_size)

    def close(self) -> None:
        """Close every instance this store holds itself (not its parent's)."""
        for option in self._own.values():
            option.close()
