"""What a process sets up before its first tensor: fast CPU kernels, and the precision the device supports.

Nothing here runs on import. Every entry point calls `use_fast_cpu_kernels()` at its start.
"""

from __future__ import annotations

import logging

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.train")

VAE_DTYPES = ("float32", "float16", "bfloat16")  # --vae_dtype


def use_fast_cpu_kernels() -> None:
    """MKL's AVX2 kernels on AMD CPUs (`ldm.runtime.cpu`) and the fast bias add of CPU convolutions
    (`ldm.runtime.compat.fast_conv_bias`). Changes the process: an environment variable MKL reads at its first
    call (so: before any tensor work) and `paddle.nn.functional.conv2d`. Both leave results unchanged."""
    from ldm.runtime.cpu import choose_mkl_kernels

    choose_mkl_kernels()  # before Paddle is imported here
    from ldm.runtime.compat import fast_conv_bias

    fast_conv_bias()


def resolve_precision(requested: str, what: str = "training") -> str:
    """The mixed-precision mode to use: the requested one, or "no" with a message if unsupported here."""
    import paddle

    supported = {"fp16": paddle.amp.is_float16_supported, "bf16": paddle.amp.is_bfloat16_supported}
    if requested in supported and not supported[requested]():
        logger.warning("%s mixed precision is not supported on this device (%s): %s in fp32",
                       requested, paddle.device.get_device(), what)
        return "no"
    if requested == "bf16" and paddle.device.get_device() == "cpu":
        # Paddle says bf16 is supported on a CPU, but its O1 autocast casts nothing there (and it has no CPU bf16
        # conv2d kernel): a run asking for bf16 computes in fp32, so it is said and recorded as fp32
        logger.warning("bf16 mixed precision on a CPU: Paddle's autocast casts nothing there, %s in fp32", what)
        return "no"
    return requested


def resolve_vae_dtype(requested: str) -> str:
    """`--vae_dtype` where this device supports it, else float32 with a message."""
    if requested == "float32":
        return requested
    short = "fp16" if requested == "float16" else "bf16"
    return requested if resolve_precision(short, "encoding with the autoencoder") == short else "float32"


class DeviceError(UserError, ValueError):
    """Asked of this device what it cannot do. One line."""


def check_sharding(stages: set[str], split_param: bool = False) -> None:
    """Refuse, before anything is written, the sharding that needs an accelerator: stages 2 and 3 go through
    Paddle's `group_sharded_parallel`, and `split_param` through the V2 sharding optimizer, both of which assert a
    GPU (XPU, custom device) deep in the first update. Stage 1 runs anywhere, gloo included."""
    import paddle

    if paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu() or paddle.device.get_all_custom_device_type():
        return
    needs = sorted(stages & {"stage2", "stage3"}) + (["split_param"] if split_param else [])
    if needs:
        raise DeviceError(f"sharding {' and '.join(needs)} needs a GPU (Paddle's group_sharded_parallel and sharding "
                          "optimizer V2 assert one); on a CPU use --sharding stage1")
