"""Intel MKL's fast kernels on AMD CPUs.

Paddle's CPU build does its matrix products (matmul, and conv2d through im2col) in the Intel MKL it
ships (`libmklml_intel.so`). That MKL picks its kernels by CPU vendor: on an AMD CPU it runs a
generic path, several times slower for a float32 matmul than its AVX2 kernels on the same core
(`scripts/bench_cpu_kernels.py` measures it; figures in docs/benchmarks.md). This MKL still reads
`MKL_DEBUG_CPU_TYPE` (Intel dropped it from MKL 2020.1 on; a Paddle that ships a newer MKL ignores it,
harmlessly), and 5 selects the AVX2 kernels. MKL reads the variable at its first call, so setting it at
an entry point's start (`ldm.runtime.device.use_fast_cpu_kernels`, before any tensor work) reaches the process
and every process it starts. Nothing else in the stack does this: Paddle leaves the choice to the user.

Only where `/proc/cpuinfo` tells the CPU (Linux), only on AMD CPUs and their Hygon derivatives that
have AVX2 (the kernels it selects need it), and never over a value the user set:
`MKL_DEBUG_CPU_TYPE=` (empty) keeps MKL's own choice (measured as slow as unset).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

AVX2_KERNELS = "5"
VENDORS = {"AuthenticAMD", "HygonGenuine"}  # CPUs MKL does not give its own fast paths


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(vendor_id, flags) of the first CPU in `cpuinfo`; ("", set()) where it cannot be read."""
    vendor, flags = "", set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, flags


def choose_mkl_kernels(environ: MutableMapping[str, str] = os.environ, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Set MKL_DEBUG_CPU_TYPE=5 in `environ` on an AMD CPU with AVX2 unless already set; True if set."""
    if "MKL_DEBUG_CPU_TYPE" in environ:
        return False
    vendor, flags = cpu_identity(cpuinfo)
    if vendor not in VENDORS or "avx2" not in flags:
        return False
    environ["MKL_DEBUG_CPU_TYPE"] = AVX2_KERNELS
    return True
