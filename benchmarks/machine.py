"""What the benchmarks record about the machine: CPU, versions, memory bandwidth, load, a
process's peak memory. numpy and the standard library only (the OpenVINO worker imports it
from its own environment)."""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from pathlib import Path

import numpy as np


def info(threads: int) -> dict:
    """CPU model and cores from /proc/cpuinfo, Python and package versions."""
    cpu, cores = "unknown", set()
    try:
        phys = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key == "physical id":
                phys = value
            elif key == "core id":
                cores.add((phys, value))
    except OSError:
        pass
    versions = {}
    for pkg in ("draftproof", "numpy", "torch", "transformers", "onnxruntime", "onnxruntime-genai",
                "tokenizers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": len(cores) or None,
            "usable_cpus": len(os.sched_getaffinity(0)), "threads": threads,
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": versions}


def describe(info: dict | None) -> str:
    """One line for a report: CPU, cores, threads, Python, platform, the versions that are
    installed (`info` as info() returns it, or as a run's JSON stored it)."""
    if not info:
        return "not recorded"
    cores = [f"{info[k]} {what}" for k, what in (("physical_cores", "physical cores"),
                                                 ("logical_cpus", "logical"),
                                                 ("usable_cpus", "usable")) if info.get(k)]
    parts = [str(info.get("cpu", "unknown CPU"))] + ([" / ".join(cores)] if cores else [])
    if info.get("threads"):
        parts.append(f"{info['threads']} threads")
    parts.append(f"Python {info.get('python', '?')} on {info.get('platform', '?')}")
    versions = ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items() if v)
    return ", ".join(parts) + (f"; {versions}" if versions else "")


def copy_bandwidth(mib: int = 512, tries: int = 5) -> dict:
    """Best-of-`tries` numpy copy of a `mib` MiB array (one thread). Bandwidth counts the bytes
    read plus the bytes written (STREAM's convention for Copy)."""
    src = np.ones(mib * 2**20 // 8)
    dst = np.zeros_like(src)  # both touched, so page faults stay out of the timing
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return {"array_bytes": src.nbytes, "best_s": best, "GBps": 2 * src.nbytes / best / 1e9}


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM, the high-water mark of its own memory map.
    (ru_maxrss would not do: Linux carries the parent's peak over fork and exec into it.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


BUSY_LOAD = 0.5  # a 1-minute load average above this before a run: other work shared the cores


def busy_note(before: float, after: float) -> list[str]:
    """The 1-minute load average includes this run's own threads at the end, not at the start:
    anything above BUSY_LOAD before means other work shared the cores."""
    if before > BUSY_LOAD:
        return [f"the machine was busy (load average {before:.2f} before the run, {after:.2f} "
                "after): treat these figures as indicative only"]
    return []
