"""The fused update kernel for a CPU (`csrc/flat_update.c`), compiled on first use with the machine's C compiler
and loaded with ctypes; and the choice of the update's form (`--flat_update`).

Paddle has no kernel that steps AdamW, the clip's scale and the EMA in one pass, and its CPU update kernels run on
one thread; a custom Paddle operator would need Paddle's headers and a C++ build of a minute per Paddle version, where
these two plain C functions over raw fp32 pointers compile in well under a second. The library is cached by the
hash of its source, compiler command, machine, C library and compiler (what `--version` and `-dumpmachine` say) and
by its own digest (`$LDM_KERNEL_CACHE`, default `~/.cache/ldm/kernels`, which may be shared by unlike nodes): written
under a temporary name of its process and node and linked into place only if absent and a shared object, so ranks
or nodes compiling at once never load a half-written file nor replace one another's, and checked against its digest
before each load (a truncated library crashes the dynamic loader). Without a compiler (or OpenMP) `load` returns
None with the reason, and the flat update runs Paddle's kernels instead."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import time

import numpy as np

from ldm.runtime.cpu import cpu_identity
from ldm.runtime.device import DeviceError

logger = logging.getLogger("ldm.train")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "flat_update.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off"]
FLT_MAX = float(np.finfo(np.float32).max)
MAX_THREADS = 1024  # OpenMP's own limit is far above; more threads than this only crash its allocator


def resolve_flat_update(requested: str) -> str | None:
    """`--flat_update`: the form of the update, "fused", "flat" or None (per tensor, `off`).

    - fused: flat buffers, and on a CPU one pass of the clip's factor, AdamW and the EMA on the process's share of
      the cores (this module's kernel, compiled with the machine's C compiler);
    - on: flat buffers, Paddle's kernels (a few per span);
    - auto: fused on a CPU when it compiles, else flat. Measured on a 2-core CPU (docs/benchmarks.md,
      `scripts/bench_update.py`): 0.20-0.21 of the per-tensor update's time, flat 0.83-0.84. On a GPU the flat
      form: there the per-tensor update is bound by its thousands of kernel launches, which it makes a few (not
      measured here).

    `LDM_UPDATE_THREADS` is checked whatever the form: a value out of reason is refused alike by every form."""
    update_threads()
    if requested == "off":
        return None
    import paddle

    on_cpu = paddle.device.get_device().startswith("cpu")
    if requested == "on" or (requested == "auto" and not on_cpu):
        return "flat"
    if not on_cpu:
        raise DeviceError("--flat_update fused is a CPU kernel; on this device use --flat_update on (or auto)")
    kernel, why = load()
    if kernel is None:
        if requested == "fused":
            raise DeviceError(f"--flat_update fused: {why}")
        logger.warning("flat update: Paddle's kernels, not the fused one (%s)", why)
        return "flat"
    return "fused"


def agreed_flat_update(requested: str, dist) -> str | None:
    """`resolve_flat_update` on every rank of `dist` (`ldm.runtime.distributed.Distributed`; a collective): one form
    for all, so that replicas never step by different arithmetic. The fused pass only where it builds on every
    rank (else, under auto, the flat form everywhere, said once); a refusal on any rank is every rank's."""
    try:
        form, refused = resolve_flat_update(requested), ""
    except DeviceError as error:
        form, refused = None, str(error)
    outcomes = dist.gather((form, refused))
    refusals = [(rank, why) for rank, (_, why) in enumerate(outcomes) if why]
    if refusals:
        rank, why = refusals[0]
        raise DeviceError(why if dist.world_size == 1 else f"{why} (rank {rank})")
    forms = [form for form, _ in outcomes]
    if "fused" in forms and "flat" in forms:
        if dist.is_main:
            logger.warning("flat update: Paddle's kernels on every rank: the fused kernel did not build on rank(s) "
                           "%s", ", ".join(str(rank) for rank, form in enumerate(forms) if form == "flat"))
        return "flat"
    return form


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("LDM_KERNEL_CACHE") or os.path.join("~", ".cache", "ldm", "kernels"))


def update_threads() -> int:
    """The kernel's threads: this process's share of the cores it may run on (`paddle.distributed.launch`'s ranks
    on one node share them), or `$LDM_UPDATE_THREADS`."""
    asked = os.environ.get("LDM_UPDATE_THREADS")
    if asked:
        if not (asked.isascii() and asked.isdigit()) or not 1 <= int(asked) <= MAX_THREADS:
            raise DeviceError(f"LDM_UPDATE_THREADS must be a whole number of threads from 1 to {MAX_THREADS}, not "
                              f"{asked!r}")
        return int(asked)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("PADDLE_LOCAL_SIZE") or 1)))


def arithmetic_flags() -> list[str]:
    """Paddle's CPU AdamW is a JIT kernel of fused multiply-adds where the CPU has AVX-512, and its plain C++
    reference elsewhere: the kernel is compiled to round as the one Paddle runs here does."""
    _, flags = cpu_identity()
    if "avx512f" in flags:
        return ["-mavx2", "-mfma", "-DLDM_FMA"]
    return ["-mavx2"] if "avx2" in flags else []


class FusedKernel:
    """`sum_squares(...)` and `adamw_ema(...)` over contiguous fp32 CPU tensors (`csrc/flat_update.c`)."""

    def __init__(self, library: ctypes.CDLL, threads: int):
        self.library, self.threads = library, threads
        f, p, i64 = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
        library.ldm_sum_squares.restype = None
        library.ldm_sum_squares.argtypes = [p, p, p, i64, p, ctypes.c_int]
        library.ldm_adamw_ema.restype = None
        library.ldm_adamw_ema.argtypes = [p, p, p, p, p, p, i64, i64, f, f, f, f, f, f, ctypes.c_int]

    def sum_squares(self, tensor, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The sum of squares of each segment [starts[k], starts[k] + sizes[k]) of `tensor`, in double."""
        starts, sizes = np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(sizes, np.int64)
        out = np.empty(len(starts), np.float64)
        self.library.ldm_sum_squares(tensor.data_ptr(), starts.ctypes.data, sizes.ctypes.data, len(starts),
                                     out.ctypes.data, self.threads)
        return out

    def adamw_ema(self, weight, grad, moment1, moment2, averages=(), *, grad_scale: float, decay_rate: float,
                  beta1: float, beta2: float, step: float, eps: float, ema_weights=()) -> None:
        """One pass of AdamW, and of each average of `averages` with its weight of `ema_weights` (the EMA's and the
        post-hoc EMA's profiles: the weights are read once for all), over flat buffers of equal length; `grad` is
        zero after it."""
        n = weight.shape[0]
        assert len(averages) == len(ema_weights)
        assert all(t.shape[0] == n for t in (grad, moment1, moment2, *averages))
        pointers = (ctypes.c_void_p * max(1, len(averages)))(*(a.data_ptr() for a in averages))
        weights = (ctypes.c_float * max(1, len(averages)))(*ema_weights)
        self.library.ldm_adamw_ema(weight.data_ptr(), grad.data_ptr(), moment1.data_ptr(), moment2.data_ptr(),
                                   pointers, weights, len(averages), n, grad_scale, decay_rate, beta1, beta2, step,
                                   eps, self.threads)


def compile_into(command: list[str], prefix: str) -> str:
    """Compile the source into `prefix`-<digest>.so (the digest of the library itself, checked before each load: a
    damaged library is never handed to the dynamic loader, which may crash on one); "" or why it failed. The
    output is written under a name of its own (this process's pid and node) and linked into place only if it is a
    shared library: a "compiler" that exits 0 and writes nothing leaves nothing behind."""
    folder = os.path.dirname(prefix)
    os.makedirs(folder, exist_ok=True)
    remove_stale_partials(folder)
    fd, partial = tempfile.mkstemp(prefix=f"{os.path.basename(prefix)}.{os.getpid()}@{os.uname().nodename}.",
                                   suffix=".so.partial", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([*command, SOURCE, "-o", partial], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()
            said = next((line for line in said if "error" in line), said[-1] if said else "")
            return f"{command[0]} failed ({said or f'exit code {done.returncode}'})"
        if not is_library(partial):
            return f"{command[0]} made no shared library (exit code 0, {os.path.getsize(partial)} bytes written)"
        os.chmod(partial, 0o755)  # other users of a shared cache load it too
        with contextlib.suppress(FileExistsError):  # only if absent: a library another process loaded stays
            os.link(partial, f"{prefix}-{digest(partial)}.so")
        return ""
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


PARTIAL = re.compile(r"\.(\d+)@(.+)\.[^.]+\.so\.partial$")  # <prefix>.<pid>@<node>.<random>.so.partial
STALE_PARTIAL_SECONDS = 600  # a compile is given 120 s: a partial file this old was left by a process killed


def remove_stale_partials(folder: str) -> None:
    """Remove the partial outputs of compiles that were killed: this node's whose process is gone, and any node's
    older than `STALE_PARTIAL_SECONDS` (a shared cache: another node's pids mean nothing here)."""
    node = os.uname().nodename
    for path in glob.glob(os.path.join(glob.escape(folder), "*.so.partial")):
        match = PARTIAL.search(os.path.basename(path))
        with contextlib.suppress(OSError):
            if match and match.group(2) == node:
                stale = not os.path.exists(f"/proc/{match.group(1)}") if os.path.isdir("/proc") else False
            else:
                stale = False
            if stale or time.time() - os.path.getmtime(path) > STALE_PARTIAL_SECONDS:
                os.unlink(path)


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def is_library(path: str) -> bool:
    """Whether `path` starts as a shared object does (ELF)."""
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def cached(prefix: str, any_compiler: bool = False) -> list[str]:
    """The libraries built under `prefix` (`any_compiler`: under `prefix`-<any compiler>) whose content is their
    name's digest; damaged ones are removed."""
    found = []
    for path in sorted(glob.glob(glob.escape(prefix) + ("-*" if any_compiler else "") + "-*.so")):
        if not re.fullmatch(r"[0-9a-f]{16}", path[:-3].rpartition("-")[2]):
            continue
        if path.endswith(f"-{digest(path)}.so") and is_library(path):
            found.append(path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return found


def compiler_identity(compiler: list[str]) -> str:
    """What the compiler says it is (`--version`, `-dumpmachine`): two releases, or two targets, under one name
    build libraries that need different runtimes (libgomp)."""
    said = []
    for flag in ("--version", "-dumpmachine"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            said.append(subprocess.run([*compiler, flag], capture_output=True, text=True, timeout=30).stdout.strip())
    return "\n".join(said)


def c_library() -> str:
    """The C library's name and version (a library built against a newer glibc does not load with an older one)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return " ".join(platform.libc_ver())


def short_hash(*parts: str | bytes) -> str:
    return hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts)).hexdigest()[:16]


@functools.cache
def load() -> tuple[FusedKernel | None, str]:
    """(the kernel, "") or (None, why not): compiled once per source, compiler command, machine, C library and
    compiler (what it says it is), then cached as `flat_update-<those>-<the compiler>-<digest>.so`. Where no compiler
    is on the PATH, any compiler's library for the rest that loads here is taken. A library that does not load here
    (it needs a shared object this node lacks, on a cache shared by unlike nodes) is built once more, under a name
    that also holds this node's."""
    try:
        compiler = shlex.split(os.environ.get("CC") or "cc") or ["cc"]
    except ValueError as error:
        return None, f"$CC is not a command ({error})"
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
        command = [*compiler, *FLAGS, *arithmetic_flags()]
        stem = os.path.join(cache_dir(), f"flat_update-{short_hash(source, platform.machine(), *command, c_library())}")
        if not shutil.which(compiler[0]):
            for path in cached(stem, any_compiler=True):
                with contextlib.suppress(OSError):
                    return FusedKernel(ctypes.CDLL(path), update_threads()), ""
            return None, f"no C compiler ({compiler[0]}; $CC names another) on the PATH"
        identity = compiler_identity(compiler)
        failed = ""
        for prefix in (f"{stem}-{short_hash(identity)}", f"{stem}-{short_hash(identity, os.uname().nodename)}"):
            found = cached(prefix)
            if not found:
                why = compile_into(command, prefix)
                if why:
                    return None, why
                found = cached(prefix)
                if not found:
                    return None, f"{compiler[0]} made no library in {cache_dir()}"
            try:
                library = ctypes.CDLL(found[0])
            except OSError as error:  # built on another node: built again, under this node's name
                failed = f"{failed}; then {error}" if failed else str(error)
                logger.info("flat update: the cached kernel does not load here (%s): building it for this node", error)
                continue
            return FusedKernel(library, update_threads()), ""
        return None, f"the kernel does not load here ({failed})"
    except (OSError, TypeError, subprocess.SubprocessError) as error:
        return None, f"building or loading the kernel in {cache_dir()} ($LDM_KERNEL_CACHE) failed: {error}"
