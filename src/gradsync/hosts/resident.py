"""This process's resident memory as Linux reports it: the resident set, its peak, and the heap given back.

``/proc/self/status`` gives the resident set (``VmRSS``), its high-water mark
(``VmHWM``) and their parts (``RssFile``: file-backed pages, ``RssShmem``:
shared-memory pages); ``/proc/self/smaps_rollup`` this process's
proportional share of the pages it shares (``Pss_Shmem``). Writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0) resets the high-water mark to the
resident set now, so that the peak of one stretch of work can be read
(``Documentation/filesystems/proc.rst``); it also lowers ``getrusage``'s
``ru_maxrss``, so the peak before a reset is kept here and
:func:`peak_resident_bytes` answers the process's whole peak, or the peak
since a given :func:`reset_peak`. :func:`trim_heap` is glibc's
``malloc_trim(0)``: the free memory glibc's heaps keep for reuse is given back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util

STATUS = "/proc/self/status"
ROLLUP = "/proc/self/smaps_rollup"
CLEAR_REFS = "/proc/self/clear_refs"
RESET_PEAK = "5"  # clear_refs: reset the peak resident set size

_before_resets = 0  # the highest high-water mark a reset cleared


def kib_fields(path: str) -> dict[str, int]:
    """The ``Name: <n> kB`` lines of a /proc file, in bytes ({} when it cannot be read)."""
    fields = {}
    try:
        with open(path, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    fields[name.strip()] = int(parts[0]) * 1024
    except OSError:
        pass
    return fields


def resident_bytes() -> int:
    """This process's resident set now (``VmRSS``), 0 where /proc does not say."""
    return kib_fields(STATUS).get("VmRSS", 0)


def peak_resident_bytes(since_reset: bool = False) -> int:
    """This process's resident high-water mark: over its whole life (the peaks :func:`reset_peak` cleared
    included), or ``since_reset`` (``VmHWM``: since the last reset)."""
    now = kib_fields(STATUS).get("VmHWM", 0)
    return now if since_reset else max(now, _before_resets)


def reset_peak() -> bool:
    """Reset the resident high-water mark to the resident set now (the peak so far is kept for
    :func:`peak_resident_bytes`); False where the kernel does not allow it."""
    global _before_resets
    peak = peak_resident_bytes()
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as file:
            file.write(RESET_PEAK)
    except OSError:
        return False
    _before_resets = peak
    return True


def trim_heap() -> bool:
    """Give the free memory of glibc's heaps back to the kernel (``malloc_trim(0)``); False without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError, TypeError):
        return False
