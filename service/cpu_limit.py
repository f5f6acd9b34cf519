"""How many CPUs this process may really use: the container's CPU limit, not the node's core count.

A pod limited to `cpu: 2` on a 64-core node still sees 64 cores in `os.cpu_count()` and in its
affinity mask; torch and FAISS (OpenMP) size their pools from that, and 64 threads sharing 2 CPUs of
quota spend their time throttled (CFS gives the quota per 100 ms period, and the threads burn it in
a few ms).  The limit lives in the cgroup files:

    cgroup v2   /sys/fs/cgroup/<group>/cpu.max                      "QUOTA PERIOD" or "max PERIOD"
    cgroup v1   /sys/fs/cgroup/cpu[,cpuacct]/<group>/cpu.cfs_quota_us and cpu.cfs_period_us  (quota -1: none)

<group> is this process's own, from /proc/self/cgroup; the tightest limit of it and its ancestors wins.

usable = min(CPUs in the affinity mask, ceil(quota / period)), at least 1.  A fractional limit
rounds up: 1.5 CPUs of quota keep two threads busy 75 % of the time, better than one thread at 100 %.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 mounts the cpu controller under one of these names, depending on the distribution.
V1_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    """A cgroup file's stripped text, or None when it is absent or unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    """quota / period as CPUs; None for no limit ("max", -1) or numbers that make no sense."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": unlimited
    return q / p if q > 0 and p > 0 else None


def _own_paths(proc_cgroup: Path) -> tuple[str, str]:
    """This process's (v2 path, v1 cpu path) from /proc/self/cgroup; "/" where a line is missing.

    In a container with its own cgroup namespace both are "/" (the mount shows the container's own
    group); a process on a host (a systemd unit) sits deeper, and the limit may be on any ancestor.
    """
    v2, v1 = "/", "/"
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path, then each parent group up to base itself (the effective limit is the smallest)."""
    parts = [part for part in path.split("/") if part and part != ".."]
    return [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _smallest(limits: list[float | None]) -> float | None:
    """The tightest of the limits found, None when none is set."""
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota in CPUs (e.g. 1.5) from cgroup v2, else v1; None when there is no limit."""
    v2_path, v1_path = _own_paths(proc_cgroup)
    if (root / "cpu.max").exists():  # a pure v2 mount (hybrid hosts keep v2 under unified/, without cpu)
        limits = []
        for group in _ancestors(root, v2_path):
            parts = (_read(group / "cpu.max") or "").split()
            limits.append(_ratio(parts[0], parts[1]) if len(parts) == 2 else None)
        return _smallest(limits)
    for name in V1_DIRS:
        if not (root / name / "cpu.cfs_quota_us").exists():
            continue
        limits = []
        for group in _ancestors(root / name, v1_path):
            quota, period = _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
            limits.append(_ratio(quota, period) if quota is not None and period is not None else None)
        return _smallest(limits)
    return None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (cpusets, taskset), or os.cpu_count() where there is none."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """min(affinity CPUs, ceil(cgroup CPU limit)), at least 1: the thread budget of the whole process."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def omp_threads_default(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> str | None:
    """OMP_NUM_THREADS to set when a CPU limit is below the affinity mask; None when OpenMP's own count is right."""
    usable = usable_cpus(root, proc_cgroup)
    return str(usable) if usable < affinity_cpus() else None
