"""ldm.runtime.cpu: MKL's AVX2 kernels chosen on AMD CPUs with AVX2, and nowhere else."""

import os
import subprocess
import sys

import pytest

from ldm.runtime.cpu import choose_mkl_kernels, cpu_identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpuinfo(tmp_path, vendor: str, flags: str, flags_first: bool = False) -> str:
    path = tmp_path / "cpuinfo"
    lines = [f"vendor_id\t: {vendor}\n", "model name\t: X\n", f"flags\t\t: {flags}\n"]
    if flags_first:
        lines.reverse()
    path.write_text("".join(f"processor\t: {i}\n" + "".join(lines) + "\n" for i in range(2)))
    return str(path)


@pytest.mark.parametrize("vendor, flags, flags_first, chosen", [
    ("AuthenticAMD", "fpu sse2 avx avx2 fma", False, True),
    ("AuthenticAMD", "fpu sse2 avx avx2 fma", True, True),
    ("HygonGenuine", "fpu sse2 avx avx2", False, True),  # AMD's Zen under another name
    ("AuthenticAMD", "fpu sse2 avx", False, False),  # the AVX2 kernels would not run
    ("GenuineIntel", "fpu sse2 avx avx2 avx512f", False, False),  # MKL already picks its best kernels
])
def test_the_variable_is_set_only_on_an_amd_cpu_with_avx2(tmp_path, vendor, flags, flags_first, chosen):
    environ = {}
    assert choose_mkl_kernels(environ, cpuinfo(tmp_path, vendor, flags, flags_first)) is chosen
    assert environ == ({"MKL_DEBUG_CPU_TYPE": "5"} if chosen else {})


def test_an_arm_cpuinfo_sets_nothing(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n\n")
    environ = {}
    assert cpu_identity(str(path)) == ("", set())
    assert not choose_mkl_kernels(environ, str(path))
    assert environ == {}


@pytest.mark.parametrize("value", ["", "4"])
def test_a_value_the_user_set_is_kept_even_empty(tmp_path, value):
    environ = {"MKL_DEBUG_CPU_TYPE": value}
    assert not choose_mkl_kernels(environ, cpuinfo(tmp_path, "AuthenticAMD", "avx2"))
    assert environ == {"MKL_DEBUG_CPU_TYPE": value}


def test_an_unreadable_cpuinfo_sets_nothing(tmp_path):
    environ = {}
    assert cpu_identity(str(tmp_path / "missing")) == ("", set())
    assert not choose_mkl_kernels(environ, str(tmp_path / "missing"))
    assert environ == {}


def test_the_entry_points_start_up_makes_the_choice_for_the_process_and_its_children():
    """`use_fast_cpu_kernels()`, which every entry point calls first, decides before it imports Paddle (so
    before MKL's first call), and a process it starts (a launched rank, a loader worker) inherits the choice;
    `import ldm` alone decides nothing."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    code = ("import os, subprocess, sys, ldm, ldm.runtime.device; "
            "print(os.environ.get('MKL_DEBUG_CPU_TYPE'), flush=True); import ldm.runtime.cpu; "
            "ldm.runtime.cpu.choose_mkl_kernels = (lambda f: lambda: (print('paddle' in sys.modules), f()))"
            "(ldm.runtime.cpu.choose_mkl_kernels); ldm.runtime.device.use_fast_cpu_kernels(); "
            "print(os.environ.get('MKL_DEBUG_CPU_TYPE'), flush=True); "
            "subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"MKL_DEBUG_CPU_TYPE\"))'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    expected = "5" if choose_mkl_kernels({}) else "None"  # what this machine's /proc/cpuinfo calls for
    assert out == ["None", "False", expected, expected]
