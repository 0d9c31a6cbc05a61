"""How much host memory there is to take: ``MemAvailable``, bounded by the room left under a memory cgroup's
limit. The offloaded optimizer checks it before pinning any block; the float32 referee before running on the host
(``verify/referee.py``)."""

from __future__ import annotations

import os

__all__ = ["available_host_bytes"]  # pinned_host.py also imports _check_host_memory by name


def available_host_bytes() -> int:
    """Host memory the kernel can hand out without swapping: ``MemAvailable`` (free + reclaimable
    page cache), or free pages where /proc/meminfo is missing; in a container whose memory cgroup has a
    limit, no more than the room left under it. /proc/meminfo shows the whole machine there, and going
    over the cgroup's limit gets the process killed instead of a MemoryError."""
    available = None
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return available if room is None else min(available, room)


# Where the memory cgroup's files are (a module constant so tests can point it at a directory of theirs).
_CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 1 << 60

# (limit, usage, memory.stat key of reclaimable page cache) per cgroup version.
_CGROUP_FILES = (("memory.max", "memory.current", "file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_cache"))


def _cgroup_room() -> int | None:
    """Bytes left under this process's memory cgroup limit (usage minus reclaimable page cache); None
    without a limit or without cgroup files."""
    for limit_file, usage_file, cache_key in _CGROUP_FILES:
        limit_text = _read(os.path.join(_CGROUP_ROOT, limit_file))
        usage_text = _read(os.path.join(_CGROUP_ROOT, usage_file))
        if limit_text is None or usage_text is None:
            continue
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        stat_file = os.path.join(_CGROUP_ROOT, os.path.dirname(limit_file), "memory.stat")
        cache = _stat_value(_read(stat_file) or "", cache_key)
        return max(0, int(limit_text) - int(usage_text) + cache)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_value(stat: str, key: str) -> int:
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _check_host_memory(needed: int, what: str) -> None:
    available = available_host_bytes()
    if needed > available:
        raise MemoryError(
            f"OffloadedOptimizer needs {needed} bytes ({needed / 2**30:.2f} GiB) of pinned host memory "
            f"for {what}, but only {available} bytes ({available / 2**30:.2f} GiB) are available "
            "(MemAvailable): keep more of the states on the GPU (gpu_fraction=...) or free host memory")
