"""ldm.cpu: MKL's AVX2 kernels chosen on AMD CPUs with AVX2, and nowhere else."""

import os
import subprocess
import sys

import pytest

from ldm.cpu import choose_mkl_kernels, cpu_identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpuinfo(tmp_path, vendor: str, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {i}\nvendor_id\t: {vendor}\nmodel name\t: X\nflags\t\t: {flags}\n\n"
                            for i in range(2)))
    return str(path)


@pytest.mark.parametrize("vendor, flags, chosen", [
    ("AuthenticAMD", "fpu sse2 avx avx2 fma", True),
    ("AuthenticAMD", "fpu sse2 avx", False),  # the AVX2 kernels would not run
    ("GenuineIntel", "fpu sse2 avx avx2 avx512f", False),  # MKL already picks its best kernels
])
def test_the_variable_is_set_only_on_an_amd_cpu_with_avx2(tmp_path, vendor, flags, chosen):
    environ = {}
    assert choose_mkl_kernels(environ, cpuinfo(tmp_path, vendor, flags)) is chosen
    assert environ == ({"MKL_DEBUG_CPU_TYPE": "5"} if chosen else {})


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


def test_importing_ldm_makes_the_choice_for_the_process_and_its_children():
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    code = ("import ldm, os, subprocess, sys; print(os.environ.get('MKL_DEBUG_CPU_TYPE')); "
            "subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"MKL_DEBUG_CPU_TYPE\"))'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    vendor, flags = cpu_identity()
    expected = "5" if vendor == "AuthenticAMD" and "avx2" in flags else "None"
    assert out == [expected, expected]
