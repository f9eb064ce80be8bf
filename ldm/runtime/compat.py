"""Every use of a private Paddle or PaddleNLP API, in one place, checked against an upgrade.

The project is tested with the versions in requirements.lock (`SUPPORTED`). Each function here
names the private attributes it relies on; when an upgrade has removed one, it raises
`CompatibilityError` naming them and the supported versions, at start-up where possible, instead of
an AttributeError deep in a run, or (worse) a subclass hook that is silently never called.
tests/test_runtime_compat.py checks every shim against the installed versions. A model family's own shims of
ppdiffusers' classes (PixArt's caption projection, SD3's attention) live with the family (`ldm.models.families`),
through `private` too.
"""

from __future__ import annotations

import logging

from ldm.runtime.errors import UserError

logger = logging.getLogger("ldm.data")

SUPPORTED = "paddlepaddle 3.3, paddlenlp 2.8.1, ppdiffusers 0.29.0"


class CompatibilityError(UserError, RuntimeError):
    pass


def installed_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("paddlepaddle", "paddlepaddle-gpu", "paddlenlp", "ppdiffusers"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found)


def private(owner, name: str, use: str):
    """`owner.name`, or a CompatibilityError saying what needs it and which versions have it."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__qualname__
        raise CompatibilityError(f"{use} needs {where}.{name}, which the installed {installed_versions()} lacks; "
                                 f"this project supports {SUPPORTED} (requirements.lock)") from None


# --- ppdiffusers and PaddleNLP: loading weights in shares --------------------------------------------

SHARD_LOADERS = ("ppdiffusers.models.modeling_utils", "paddlenlp.transformers.model_utils")


def quiet_shard_loading() -> None:
    """Every checkpoint of a run on several processes holds its weights in shares; both libraries' `from_pretrained`
    draws a progress bar for those ("Loading checkpoint shards", a line of carriage returns in a log file) with no
    flag to turn it off: their module-level `tqdm` is replaced by one that draws nothing."""
    import functools
    import importlib

    from tqdm import tqdm

    for name in SHARD_LOADERS:
        module = importlib.import_module(name)
        private(module, "tqdm", "keeping the logs free of weight-loading progress bars")
        module.tqdm = functools.partial(tqdm, disable=True)


# --- Paddle: CPU threads -------------------------------------------------------------------------

def set_cpu_threads(threads: int) -> None:
    """The number of threads Paddle's CPU kernels use (one by default: neither an environment variable nor
    `paddle.set_flags` changes it). For tools that run one process on every core (`ldm.evaluate`)."""
    import paddle

    private(paddle.base.core, "set_num_threads", "running on several CPU threads")(int(threads))


# --- Paddle: gradient clipping and loss scaling -------------------------------------------------

def squared_l2_norm(tensor):
    """Sum of squares of a tensor in one kernel, the one Paddle's `ClipGradByGlobalNorm` uses: a
    one-element fp32 tensor (a tensor of another dtype is cast first). Called on `paddle._C_ops` directly:
    Paddle's Python wrapper costs several times the kernel on a small tensor, once per gradient per update."""
    import paddle

    if tensor.dtype != paddle.float32:
        tensor = tensor.astype("float32")
    return private(paddle._C_ops, "squared_l2_norm", "gradient clipping")(tensor)


def scale_in_place(tensor, factor: float) -> None:
    """`tensor *= factor` in the one kernel `paddle.scale` runs (a broadcast `multiply_` by a one-element
    tensor measured several times slower per gradient on a CPU). `factor` is a Python float: Paddle turns a
    tensor given here into a host scalar, a device read per call on a GPU."""
    import paddle

    private(paddle._C_ops, "scale_", "gradient clipping")(tensor, float(factor), 0.0, True)


def loss_scale(scaler):
    """The factor `scaler.scale()` multiplies a loss by now (no public getter): a tensor, or 1.0 when the
    scaler is disabled (no fp16, or a device without it)."""
    scale = private(scaler, "_scale", "logging the gradient norm under fp16")
    return 1.0 if scale is None or not private(scaler, "_enable", "logging the gradient norm under fp16") else scale


def innermost_optimizer(optimizer):
    """The Paddle optimizer inside fleet's wrappers (which hold it as `_inner_opt`)."""
    while getattr(optimizer, "_inner_opt", None) is not None:
        optimizer = optimizer._inner_opt
    return optimizer


def sharding_owners(optimizer):
    """({parameter name: the sharding rank that holds its optimizer state}, this rank's sharding rank, the sharding
    group) of fleet's sharding optimizer (stage 1, `DygraphShardingOptimizer`; stage 2's
    `GroupShardedOptimizerStage2`) wherever it sits among fleet's wrappers; None when `optimizer` is not
    sharded. Its partition is private: the checkpoint manager writes and reads each rank's part, and the EMA follows
    it."""
    use = "sharded optimizer state and EMA"
    while optimizer is not None:
        kind = type(optimizer).__name__
        if kind.startswith("DygraphShardingOptimizer"):
            owners = private(optimizer, "_param2rank", use)
            group = private(optimizer, "_hcg", use).get_sharding_parallel_group()
            return dict(owners), int(private(optimizer, "_sharding_rank", use)), group
        if kind == "GroupShardedOptimizerStage2":  # the Trainer path's stage 2 (a GPU)
            return dict(optimizer.param2rank), int(private(optimizer, "_rank", use)), private(optimizer, "_group", use)
        optimizer = getattr(optimizer, "_inner_opt", None) or getattr(optimizer, "_optim", None)
    return None


def shard_optimizer(optimizer, degree: int):
    """`optimizer` (a Paddle optimizer over every trained parameter) as fleet's stage-1 sharding optimizer over
    `degree` ranks: each rank keeps the state of, and updates, its own parameters, then broadcasts them. fleet
    is initialised here with data parallel over the rest of the ranks; gradients stay the caller's to all-reduce
    (the hand-written loop's once-per-update sync), so the norm and the non-finite guard see every gradient."""
    import paddle.distributed as dist
    from paddle.distributed import fleet

    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": world // degree, "mp_degree": 1, "pp_degree": 1,
                               "sharding_degree": degree}
    readable_strategy()
    fleet.init(is_collective=True, strategy=strategy)
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    return DygraphShardingOptimizer(optimizer, fleet.get_hybrid_communicate_group())


def readable_strategy() -> None:
    """fleet's `DistributedStrategy.__repr__` imports protobuf's C extension, which the pure-Python protobuf of
    the lock does not have: PaddleNLP logs the strategy, and the logging module printed a traceback. The repr
    falls back to the hybrid degrees there. Once per process."""
    from paddle.distributed.fleet.base.distributed_strategy import DistributedStrategy

    original = DistributedStrategy.__repr__
    if getattr(original, "readable", False):
        return

    def __repr__(self):
        try:
            return original(self)
        except ImportError:
            return f"DistributedStrategy(hybrid_configs={self.hybrid_configs})"

    __repr__.readable = True
    DistributedStrategy.__repr__ = __repr__


def skip_step_if(skip: bool, optimizer, scaler=None) -> None:
    """Make the coming optimizer step (or `scaler.step`) skip when `skip`.

    Paddle's own mechanism, the one its GradScaler uses: the optimizer's `found_inf` auxiliary variable,
    with which AdamW leaves the weights, both moments and its bias-correction counters alone; given as a
    Python bool, the step tests it without a device read. An enabled scaler hands its own `_found_inf`
    (a tensor, computed when it unscales, done here first if it was not yet) to the optimizer and lowers
    the loss scale on it: `skip` is merged into that one."""
    if scaler is not None and private(scaler, "_enable", "the non-finite guard under fp16"):
        from paddle.amp.grad_scaler import OptimizerState

        states = private(scaler, "_optimizer_states", "the non-finite guard under fp16")
        if states[id(optimizer)]["state"] is OptimizerState.INIT:
            scaler.unscale_(optimizer)
        import paddle

        mine = private(scaler, "_found_inf", "the non-finite guard under fp16")
        scaler._found_inf = paddle.logical_or(mine, paddle.full(mine.shape, skip, dtype=mine.dtype))
        return
    inner = innermost_optimizer(optimizer)
    private(inner, "_set_auxiliary_var", "the non-finite guard")("found_inf", bool(skip))


def step_was_skipped(optimizer) -> bool:
    """After a step prepared by `skip_step_if`: whether it was skipped. Paddle's dygraph step has replaced the
    flag by a Python bool when it read it; a flag still a tensor is read here (a step that did not look)."""
    found = private(innermost_optimizer(optimizer), "_get_auxiliary_var", "the non-finite guard")("found_inf")
    if found is None or isinstance(found, bool):
        return bool(found)
    return bool(found.item())


# --- Paddle: the bias add of a CPU convolution ------------------------------------------------

CONV_ND_PARAMETERS = ("x", "weight", "bias", "stride", "padding", "padding_algorithm", "dilation", "groups",
                      "data_format", "channel_dim", "op_type", "use_cudnn", "name")


def fast_conv_bias() -> bool:
    """Make Paddle's NCHW conv2d add its bias on the CPU as a [C, 1, 1] tensor instead of [1, C, 1, 1].

    Paddle 3.3 reshapes a conv's bias to [1, C, 1, 1] before the add, and its CPU kernel broadcasts
    that shape through a general path many times slower than the same add of a [C, 1, 1] bias (the
    same values; docs/benchmarks.md; `scripts/bench_cpu_kernels.py` measures the training steps).
    conv2d is reached two ways, both wrapped here, once per process: the public
    `paddle.nn.functional.conv2d` (ppdiffusers' convolutions) and the private
    `paddle.nn.functional.conv._conv_nd` (`paddle.nn.Conv2D`), the latter only while its parameters
    are the ones wrapped. Anything else (no bias, NHWC, another device, a transposed conv) takes
    Paddle's own path. Returns whether the private path is wrapped too; each wrapper keeps Paddle's
    function as `.original`."""
    import inspect

    import paddle.nn.functional as F
    import paddle.nn.functional.conv as conv
    from paddle import _C_ops

    def with_bias(convolve, x, bias, data_format):
        """`convolve(bias)`, or on a CPU NCHW tensor `convolve(None)` plus the bias as [C, 1, 1]."""
        if bias is None or data_format != "NCHW" or len(bias.shape) != 1 or not x.place.is_cpu_place():
            return convolve(bias)
        return _C_ops.add(convolve(None), bias.reshape([-1, 1, 1]))

    if not getattr(F.conv2d, "fast_conv_bias", False):
        public = F.conv2d

        def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, data_format="NCHW", name=None):
            return with_bias(lambda b: public(x, weight, b, stride, padding, dilation, groups, data_format, name),
                             x, bias, data_format)

        conv2d.__doc__, conv2d.fast_conv_bias, conv2d.original = public.__doc__, True, public
        F.conv2d = conv2d
    conv_nd = getattr(conv, "_conv_nd", None)
    if getattr(conv_nd, "fast_conv_bias", False):
        return True
    if conv_nd is None or tuple(inspect.signature(conv_nd).parameters) != CONV_ND_PARAMETERS:
        logger.warning("paddle.nn.Conv2D keeps Paddle's slower bias add on the CPU: the installed %s changed "
                       "paddle.nn.functional.conv._conv_nd (this project supports %s)", installed_versions(), SUPPORTED)
        return False

    def private_conv_nd(x, weight, bias=None, stride=1, padding=0, padding_algorithm=None, dilation=1, groups=1,
                        data_format="NCHW", channel_dim=1, op_type="conv2d", use_cudnn=True, name=None):
        def convolve(b):
            return conv_nd(x, weight, b, stride, padding, padding_algorithm, dilation, groups, data_format,
                           channel_dim, op_type, use_cudnn, name)

        return with_bias(convolve, x, bias, data_format) if op_type == "conv2d" else convolve(bias)

    private_conv_nd.fast_conv_bias, private_conv_nd.original = True, conv_nd
    conv._conv_nd = private_conv_nd
    return True


# --- PaddleNLP Trainer: the hooks `ldm.train.trainer.LDMTrainer` overrides or calls ----------------

TRAINER_HOOKS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_rotate_checkpoints",
                 "_load_rng_state")


def check_trainer_hooks() -> None:
    """An override of a hook the Trainer no longer has would never be called: fail at start instead."""
    from paddlenlp.trainer import Trainer

    for name in TRAINER_HOOKS:
        private(Trainer, name, "the Trainer path (checkpoint layout, resume)")


def save_trainer_checkpoint(trainer) -> None:
    private(trainer, "_save_checkpoint", "the Trainer path's final checkpoint")(trainer.model_wrapped, metrics=None)


# --- Paddle DataLoader: stopping its iterator in bounded time -----------------------------------

LOADER_METHODS = ("_try_shutdown_all", "_exit_thread_expectedly")
LOADER_ATTRIBUTES = ("_thread", "_thread_done_event", "_blocking_queue")  # + "_workers", "_data_queue" with workers


def check_loader_classes() -> None:
    from paddle.io.dataloader import dataloader_iter

    for cls in ("_DataLoaderIterSingleProcess", "_DataLoaderIterMultiProcess"):
        iterator_class = private(dataloader_iter, cls, "stopping the data loader")
        for name in LOADER_METHODS:
            private(iterator_class, name, "stopping the data loader")


# How often Paddle's reader thread wakes from waiting on the workers' queue (its default is 5 s);
# it is also the longest `stop_loader` waits for that thread.
READER_POLL_SECONDS = 1
# How long `stop_loader` waits for a worker to leave before it kills it: a worker stuck inside one
# record (a hung read) never looks at its queue again.
WORKER_EXIT_SECONDS = 10


def stop_loader(iterator) -> None:
    """Stop a Paddle DataLoader iterator now, in a bounded time: its reader thread first, then its workers
    and queues; a worker that has not left after `WORKER_EXIT_SECONDS` is killed.

    Left alone, Paddle stops the last iterator in an atexit hook, during interpreter shutdown, closes
    the workers' queue while its reader thread may still be reading it, and joins each worker without
    a time limit.
    """
    if not hasattr(iterator, "_try_shutdown_all"):  # Paddle's own __del__ calls it
        return
    thread = getattr(iterator, "_thread", None)
    if getattr(iterator, "_data_queue", None) is not None and thread is not None and thread.is_alive():
        iterator._exit_thread_expectedly()
        thread.join(timeout=READER_POLL_SECONDS + 10)
        if thread.is_alive():
            logger.warning("the data loader's reader thread did not stop; closing its queues anyway")
    workers = list(getattr(iterator, "_workers", None) or ())
    if not workers:
        # in-process reading: Paddle's shutdown polls its reader thread in 1 s sleeps; stop it first
        if thread is not None and thread.is_alive():
            iterator._thread_done_event.set()
            iterator._blocking_queue.close()
            thread.join(timeout=READER_POLL_SECONDS + 10)
        iterator._try_shutdown_all()
        return
    iterator._try_shutdown_all(timeout=WORKER_EXIT_SECONDS / len(workers))
    for worker in workers:
        if worker.is_alive():
            logger.warning("data loader worker %d did not stop within %g s (stuck inside a record?): killing it",
                           worker.pid, WORKER_EXIT_SECONDS)
            worker.kill()
            worker.join(timeout=10)
