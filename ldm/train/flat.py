"""The update around the step over flat buffers: every trained weight, its gradient, its AdamW moments and its EMA a
view into one contiguous buffer per dtype, so that the global norm is one reduction, AdamW one kernel per span and
the EMA one pass over the flat weights, instead of one or several kernels per tensor (846 in `ldm-12layer`).

The layout Megatron's distributed optimizer, DeepSpeed and Apex use. Parameters stay Paddle parameters with their
names and shapes (each one's storage is a slice of its dtype's buffer, as fleet's `tensor_fusion_helper` shares
them): the model, the checkpoints and the optimizer's state dict do not change, so a run resumes across the two
forms in both directions. Spans are runs of parameters of one dtype, one sharding owner and one decay setting:
under `--sharding stage1` each rank's parameters are contiguous, so its moments and EMA are flat over its span.

Paddle 3.3's own AdamW fusion storage (`Optimizer.use_fusion_storage`, `paddle/optimizer/fusion_utils.py`) was
read and not used: it packs the moments and master weights into one buffer for offloading and IPC only (GPU, NPU
or XPU; it asserts on a CPU), still runs one `adamw_` kernel per tensor, and leaves weights and gradients where they
are. Its Adam's `use_multi_tensor` (`merged_adam_`) has L2 decay, not AdamW's decoupled one.

On a CPU (`FlatAdamW.fuse`, `--flat_update fused`, and `auto`'s choice where it builds) the clip's factor, AdamW
and the EMA are one pass of a compiled kernel over the buffers, on several threads, and the norm another
(`ldm.train.native`).

What keeps a parameter a view (checked by `tests/test_train_flat.py`): `set_value`, `set_state_dict`,
`paddle.assign(..., output=)`, broadcasts and in-place kernels write into its storage. What breaks it: Paddle's
`clear_gradient` (either form) detaches the gradient, so the next backward allocates a new one; the flat optimizer
zeroes the flat gradients instead, and every step checks the views (a pointer compare per tensor) and re-attaches
any a caller replaced, copying its values in.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import paddle

from ldm.runtime.compat import private, scale_in_place, squared_l2_norm
from ldm.train.native import FLT_MAX

logger = logging.getLogger("ldm.train")

# The EMA and the casts run in chunks of this many elements: their temporaries stay small (64 MiB of fp32)
CHUNK = 1 << 24
# Each parameter starts at a multiple of this many bytes of its buffer, as Paddle's own fused buffers align them
# (`fleet/utils/tensor_fusion_helper.py`, 256 on a GPU): kernels see the alignment their own allocations had, and
# their vectorised paths and results stay those of the per-tensor run. The gaps stay zero: no gradient, no update.
ALIGN_BYTES = 256


class FreedMemory:
    """Hands memory freed while tensors move into a flat buffer back to the system every `every` bytes moved.

    Paddle frees a CPU tensor to the C library's allocator, which keeps small blocks in its heap for reuse (and
    raises its mmap threshold as large blocks are freed): a flat buffer, one large block, cannot reuse them, so the
    moved tensors would stay resident beside it and a run's peak would hold them twice. glibc's `malloc_trim`
    returns the free pages of its heap; elsewhere (another C library, a GPU) this does nothing."""

    def __init__(self, every: int = 1 << 25):
        self.every, self.moved = every, 0
        try:
            import ctypes

            self.trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self.trim = None

    def moved_bytes(self, count: int) -> None:
        self.moved += count
        if self.moved >= self.every:
            self.release()

    def release(self) -> None:
        self.moved = 0
        if self.trim is not None:
            self.trim(0)


@dataclasses.dataclass(eq=False)  # spans are compared by identity (their parameters are tensors)
class Span:
    """Parameters `params` at [start, end) of their dtype's buffers: one owner (sharding rank), one decay setting."""

    dtype: paddle.dtype
    start: int
    end: int
    params: list
    owner: int = 0
    decay: bool = True


def _attach(parameter, buffer, start: int, copy: bool = True) -> None:
    """Make `parameter`'s storage buffer[start:start + size], its values copied in first (`copy`)."""
    view = buffer._slice(start, start + parameter.size)
    if copy:
        paddle.assign(parameter.detach().reshape([-1]), output=view)
    view._share_buffer_to(parameter)
    parameter.get_tensor()._set_dims(parameter.shape)


class FlatParameters:
    """Trained parameters as views into one weight buffer and one gradient buffer per dtype.

    `owner`: {parameter name: sharding rank}, to keep each rank's parameters together; `decay(parameter)`: whether
    AdamW decays it (PaddleNLP's Trainer leaves biases and norms out). The buffers are made empty and filled tensor
    by tensor while each parameter's own storage is freed, so the weights are never held twice."""

    def __init__(self, parameters, owner: dict[str, int] | None = None, decay=None):
        owner, decay = owner or {}, decay or (lambda p: True)
        order = {id(p): i for i, p in enumerate(parameters)}
        ordered = sorted(parameters, key=lambda p: (str(p.dtype), owner.get(p.name, 0), not decay(p), order[id(p)]))
        self.parameters = ordered
        self.weights: dict[str, paddle.Tensor] = {}
        self.grads: dict[str, paddle.Tensor] = {}
        self.offset: dict[int, int] = {}  # id(parameter) -> start in its dtype's buffers
        self.spans: list[Span] = []
        sizes: dict[str, int] = {}
        for p in ordered:
            key = str(p.dtype)
            step = max(1, ALIGN_BYTES // paddle.empty([0], dtype=p.dtype).element_size())
            start = -(-sizes.get(key, 0) // step) * step
            self.offset[id(p)] = start
            sizes[key] = start + p.size
            last = self.spans[-1] if self.spans else None
            if last and last.dtype == p.dtype and last.owner == owner.get(p.name, 0) and last.decay == decay(p):
                last.end, _ = sizes[key], last.params.append(p)
            else:
                self.spans.append(Span(p.dtype, start, sizes[key], [p], owner.get(p.name, 0), decay(p)))
        freed = FreedMemory()
        with paddle.no_grad():
            for p in ordered:
                key = str(p.dtype)
                if key not in self.weights:  # empty: its pages are touched as each parameter's own are freed
                    self.weights[key] = paddle.empty([sizes[key]], dtype=p.dtype)
                    self.grads[key] = paddle.empty([sizes[key]], dtype=p.dtype)
                _attach(p, self.weights[key], self.offset[id(p)])
                self._attach_grad(p, copy=True)
                freed.moved_bytes(2 * p.size * self.weights[key].element_size())
            for buffer in (*self.weights.values(), *self.grads.values()):
                self.zero_gaps(buffer)
        freed.release()
        self.span_of = {id(p): span for span in self.spans for p in span.params}
        self.reattached = 0  # tensors a caller had replaced, found and re-attached by `ensure_views`
        # `ldm.train.native.FusedKernel` (`FlatAdamW.fuse`): the norm on its threads, and the clip's factor held in
        # `pending_scale` for the optimizer's one pass instead of a pass of its own
        self.kernel = None
        self.pending_scale = 1.0
        self.zeroed: set[int] = set()  # id(span) of the spans whose gradients the fused pass zeroed
        self.by_order = list(parameters)  # the model's order, whatever the layout
        self.segments: dict[str, np.ndarray] | None = None  # dtype -> (start, size) of each parameter, in that order

    def zero_gaps(self, buffer, span: Span | None = None) -> None:
        """Zero the alignment gaps of a buffer laid out as this one's dtype `buffer.dtype` (or as `span`, a buffer
        of that span alone)."""
        params = span.params if span else [p for p in self.parameters if p.dtype == buffer.dtype]
        base = span.start if span else 0
        ends = [self.offset[id(p)] + p.size - base for p in params]
        starts = [self.offset[id(p)] - base for p in params[1:]] + [buffer.shape[0]]
        for end, start in zip(ends, starts, strict=True):
            if start > end:
                buffer._slice(end, start).zero_()

    def _attach_grad(self, p, copy: bool = False) -> None:
        """Make `p`'s gradient its slice of the gradient buffer, holding the gradient it had (`copy`) or zeros."""
        grad = p.grad_ if copy else None
        view = self.grads[str(p.dtype)]._slice(self.offset[id(p)], self.offset[id(p)] + p.size)
        if grad is not None:
            paddle.assign(grad.reshape([-1]), output=view)
        else:
            view.zero_()
        view.get_tensor()._set_dims(p.shape)
        p._copy_gradient_from(view)

    @property
    def fused(self) -> bool:
        """Whether the fused kernel steps every span (all fp32)."""
        return self.kernel is not None

    def weight(self, span: Span) -> paddle.Tensor:
        return self.weights[str(span.dtype)]._slice(span.start, span.end)

    def grad(self, span: Span) -> paddle.Tensor:
        return self.grads[str(span.dtype)]._slice(span.start, span.end)

    def broken_views(self) -> list[tuple[object, str]]:
        """(parameter, "weight" or "gradient") for each tensor whose storage is no longer its slice of the buffers."""
        broken = []
        for p in self.parameters:
            key, start = str(p.dtype), self.offset[id(p)]
            itemsize = self.weights[key].element_size()
            if p.data_ptr() != self.weights[key].data_ptr() + start * itemsize:
                broken.append((p, "weight"))
            grad = p.grad_
            if grad is None or grad.data_ptr() != self.grads[key].data_ptr() + start * itemsize:
                broken.append((p, "gradient"))
        return broken

    @paddle.no_grad()
    def ensure_views(self) -> None:
        """Re-attach every tensor a caller replaced (its values copied into the buffers); the first time, a warning."""
        broken = self.broken_views()
        for p, what in broken:
            if what == "weight":
                _attach(p, self.weights[str(p.dtype)], self.offset[id(p)])
            else:
                self._attach_grad(p, copy=True)
        if broken and not self.reattached:
            logger.warning("flat update: %d weights or gradients had been replaced (e.g. %s's %s) and were "
                           "re-attached to the flat buffers", len(broken), broken[0][0].name, broken[0][1])
        self.reattached += len(broken)

    # -- the gradients' side of an update, as `ldm.train.gradients.TensorGradients` has it -----------------------
    @paddle.no_grad()
    def clear(self) -> None:
        """The gradients to zero in place: one fill per dtype; the views stay (Paddle's `clear_grad` would detach
        them, fleet's sharding optimizer's too)."""
        if self.zeroed:  # the fused pass zeroed the spans it stepped; under sharding, not the others'
            for span in self.spans:
                if id(span) not in self.zeroed:
                    self.grad(span).zero_()
        else:
            for grad in self.grads.values():
                grad.zero_()
        self.pending_scale, self.zeroed = 1.0, set()

    def release(self) -> None:
        """Free the gradients once the updates are over: the export loads into their memory."""
        for p in self.parameters:
            p.clear_gradient(False)
        self.grads = {}

    @paddle.no_grad()
    def norm(self) -> paddle.Tensor:
        """Global L2 norm of every gradient, fp32: one reduction per dtype."""
        if self.fused:
            return paddle.to_tensor(self.fused_norm(), dtype="float32")
        squares = [squared_l2_norm(grad) for grad in self.grads.values()]
        return paddle.sqrt(paddle.add_n(squares) if len(squares) > 1 else squares[0]).reshape([])

    def fused_norm(self) -> float:
        """The global norm by the fused kernel's threads, the clip's pending factor applied: each parameter's sum of
        squares, added up in the model's order, so that it is the same whatever the layout (sharded or not)."""
        if self.segments is None:
            self.segments = {key: np.array([(self.offset[id(p)], p.size) for p in self.by_order
                                            if str(p.dtype) == key], np.int64).reshape(-1, 2) for key in self.grads}
        with paddle.profiler.RecordEvent("ldm fused sum_squares"):
            total = sum(float(part) for key, grad in self.grads.items()
                        for part in self.kernel.sum_squares(grad, *self.segments[key].T))
        if total > FLT_MAX:  # where Paddle's float sums overflow, the guard sees the same infinite norm
            return math.inf
        return total ** 0.5 * self.pending_scale

    @paddle.no_grad()
    def scale(self, factor: float) -> None:
        if self.fused:  # the optimizer's pass multiplies each gradient as it reads it
            self.pending_scale *= float(factor)
            return
        for grad in self.grads.values():
            scale_in_place(grad, factor)

    @paddle.no_grad()
    def sync(self, world_size: int) -> None:
        """Mean of the gradients over the ranks: one all-reduce per dtype (instead of fused buckets copied in and
        out), scaled first as fleet's `fused_allreduce_gradients` does."""
        if world_size == 1:
            return
        for grad in self.grads.values():
            scale_in_place(grad, 1.0 / world_size)
            paddle.distributed.all_reduce(grad)


class FlatAdamW(paddle.optimizer.AdamW):
    """Paddle's AdamW, its update run as one `adamw_` kernel per span of flat buffers once `flatten` was called
    (before it, Paddle's own per-tensor step). The same kernel, the same arguments: the decoupled decay, the bias
    corrections and the skip on `found_inf` are Paddle's, so the result equals the per-tensor update to float
    rounding. Each parameter's moments are views into the span's flat moments, under the names Paddle gives them:
    the state dict is Paddle's own, per parameter. The bias-correction powers are one pair per span (every
    parameter of a span steps together); the state dict gives each parameter its span's.

    One difference from Paddle's per-tensor step: every flat parameter has a gradient (its view, zero until a
    backward writes it), so a trained parameter no backward ever reaches is decayed here, where Paddle skips it
    (its gradient stays None). The models freeze what they do not use (LDMBert's `to_logits`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flat: FlatParameters | None = None
        self.moments: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}  # id(span) -> flat moment 1, 2
        self.emas: list[FlatEMA] = []  # the averages the fused pass steps with the weights (`fuse`)
        self.host_pows: dict[int, tuple] = {}  # id(span) -> its bias-correction powers, fp32 on the host (`fuse`)

    @classmethod
    def like(cls, optimizer: paddle.optimizer.AdamW) -> FlatAdamW:
        """A FlatAdamW with every setting of a fresh `optimizer` (PaddleNLP's Trainer makes its AdamW itself: decay
        rule, clip, precision), over the same parameters; before the first step, when no state exists to carry."""
        use = "the flat update of the Trainer's AdamW"
        parameters = private(optimizer, "_parameter_list", use)
        if type(optimizer) is not paddle.optimizer.AdamW or private(optimizer, "_already_create_accumulator", use) \
                or not parameters or isinstance(parameters[0], dict):
            raise TypeError(f"a fresh paddle.optimizer.AdamW over a list of parameters becomes a FlatAdamW, not "
                            f"{type(optimizer).__name__}")
        return cls(private(optimizer, "_learning_rate", use), private(optimizer, "_beta1", use),
                   private(optimizer, "_beta2", use), private(optimizer, "_epsilon", use), parameters,
                   private(optimizer, "_weight_decay", use), private(optimizer, "_use_lowprecision_moment", use),
                   private(optimizer, "_lr_ratio", use), private(optimizer, "_apply_decay_param_fun", use),
                   private(optimizer, "_grad_clip", use), private(optimizer, "_lazy_mode", use),
                   private(optimizer, "_multi_precision", use), private(optimizer, "_amsgrad", use),
                   private(optimizer, "_name", use))

    def flatten(self, parameters=None, owner: dict[str, int] | None = None) -> FlatParameters:
        """Lay `parameters` out flat (default: the optimizer's; under sharding, every trained parameter, fleet
        having left the optimizer its own share) with `owner`, the sharding partition ({name: rank}); before the
        first step."""
        if self._already_create_accumulator:
            raise RuntimeError("FlatAdamW.flatten comes before the optimizer's first step")
        decay = (lambda p: self._apply_decay_param_fun(p.name)) if self._apply_decay_param_fun else None
        parameters = [p for p in (parameters or self._parameter_list) if not p.stop_gradient]
        if self._multi_precision and any(self._is_dtype_fp16_or_bf16(p.dtype) for p in parameters):
            raise RuntimeError("flat AdamW keeps no fp32 master weights of fp16/bf16 parameters (run with "
                               "--flat_update off)")
        self.flat = FlatParameters(parameters, owner, decay)
        return self.flat

    def fuse(self, kernel, emas=()) -> bool:
        """Step every span with `kernel` (`ldm.train.native.FusedKernel`): the clip's factor, AdamW and the update
        of each of `emas` (`FlatEMA`s: the EMA, the post-hoc EMA's profiles) in one pass over the flat buffers. Only
        where every weight is fp32 and AdamW has no AMSGrad, else False (Paddle's kernels, as before)."""
        if any(span.dtype != paddle.float32 for span in self.flat.spans) or self._amsgrad:
            return False
        self.flat.kernel, self.emas = kernel, [ema for ema in emas if ema is not None]
        return True

    def _add_moments_pows(self, p):
        """Paddle's moments of `p` (holding any state loaded before the first step), moved at once into the span's
        flat moments: made empty, their pages are touched as each parameter's own are freed, so that the moments are
        never held twice."""
        super()._add_moments_pows(p)
        if self.flat is None:
            return
        span = self.flat.span_of[id(p)]
        names = (self._moment1_acc_str, self._moment2_acc_str)
        self.freed = getattr(self, "freed", None) or FreedMemory()
        with paddle.no_grad():
            if id(span) not in self.moments:
                dtype = self._accumulators[names[0]][p.name].dtype
                self.moments[id(span)] = tuple(paddle.empty([span.end - span.start], dtype=dtype) for _ in names)
                for flat in self.moments[id(span)]:
                    self.flat.zero_gaps(flat, span)
            start = self.flat.offset[id(p)] - span.start
            for name, flat in zip(names, self.moments[id(span)], strict=True):
                _attach(self._accumulators[name][p.name], flat, start)
                self.freed.moved_bytes(p.size * flat.element_size())

    def _span_pows(self, span: Span):
        first = span.params[0].name
        return (self._accumulators[self._beta1_pow_acc_str][first], self._accumulators[self._beta2_pow_acc_str][first])

    def state_dict(self):
        state = super().state_dict()
        if self.flat is not None:
            for span in self.spans_with_state():
                pow1, pow2 = self._span_pows(span)
                for p in span.params:
                    state[self._accumulators[self._beta1_pow_acc_str][p.name].name] = pow1
                    state[self._accumulators[self._beta2_pow_acc_str][p.name].name] = pow2
        return state

    def spans_with_state(self) -> list[Span]:
        return [span for span in self.flat.spans if id(span) in self.moments]

    def clear_grad(self, set_to_zero: bool = True):
        if self.flat is None:
            return super().clear_grad(set_to_zero)
        self.flat.clear()

    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        if self.flat is None or not isinstance(params_grads, list):
            return super()._apply_optimize(loss, startup_program, params_grads, param_group_idx)
        self.flat.ensure_views()
        parameters = [p for p, g in params_grads if g is not None and not p.stop_gradient]
        spans = {id(self.flat.span_of[id(p)]): self.flat.span_of[id(p)] for p in parameters}
        count = sum(len(span.params) for span in spans.values())
        if count != len(parameters):  # a span is only stepped whole: a parameter without a gradient breaks that
            raise RuntimeError(f"flat AdamW: {count - len(parameters)} parameters of the stepped spans have no "
                               "gradient (run with --flat_update off)")
        if self._grad_clip is not None:
            self._clip(params_grads, len(spans) == len(self.flat.spans))
        from paddle.base.layer_helper import LayerHelper

        self.helper = LayerHelper(type(self).__name__)  # as Paddle's step makes it, for the learning rate's variable
        with paddle.static.program_guard(paddle.static.default_main_program(), paddle.static.default_startup_program()):
            self._create_global_learning_rate()
        self._create_accumulators(paddle.static.default_main_program().global_block(), parameters)
        found_inf = self._get_auxiliary_var("found_inf")
        if found_inf:  # Paddle's own handling (Optimizer._create_optimization_pass): a skipped update
            if isinstance(found_inf, paddle.Tensor):
                self._set_auxiliary_var("found_inf", True)
            return None
        if isinstance(found_inf, paddle.Tensor):
            self._set_auxiliary_var("found_inf", False)
        beta1 = self._beta1.item(0) if isinstance(self._beta1, paddle.Tensor) else self._beta1
        beta2 = self._beta2.item(0) if isinstance(self._beta2, paddle.Tensor) else self._beta2
        if self.flat.fused:
            self._fused_step(beta1, beta2, list(spans.values()))
            return None
        lr = self._global_learning_rate()
        adamw = private(paddle._C_ops, "adamw_", "the flat AdamW")
        for span in spans.values():
            moment1, moment2 = self.moments[id(span)]
            pow1, pow2 = self._span_pows(span)
            lr_ratio = 1.0 if self._lr_ratio is None else self._lr_ratio(span.params[0])
            adamw(self.flat.weight(span), self.flat.grad(span), lr, moment1, moment2, None, pow1, pow2, None, None,
                  beta1, beta2, self._epsilon, lr_ratio, self._weight_decay, span.decay, self._lazy_mode, 1000,
                  False, False, self._amsgrad)
        return None

    def _fused_step(self, beta1: float, beta2: float, spans: list[Span]) -> None:
        """The `fuse`d pass over `spans`, with the scalars Paddle's CPU `adamw_` derives from the learning rate and
        the bias-correction powers, in fp32 as it computes them; then the powers stepped as it steps them (on the
        host too: the pass reads no tensor)."""
        f32 = np.float32
        lr = f32(self.get_lr())  # the value Paddle's learning-rate tensor holds, from the schedule
        decays = []
        for ema in self.emas:
            decays.append(ema.ema.decay(ema.ema.num_updates + 1))  # the decay of the EMA's coming update
            ema.applied = (decays[-1], set())
        for span in spans:
            moment1, moment2 = self.moments[id(span)]
            pow1, pow2 = self._span_pows(span)
            if id(span) not in self.host_pows:  # once, and again after a load (`set_state_dict`)
                self.host_pows[id(span)] = (f32(pow1.item()), f32(pow2.item()))
            b1p, b2p = self.host_pows[id(span)]
            lr_ratio = f32(1.0 if self._lr_ratio is None else self._lr_ratio(span.params[0]))
            stepped = [(ema, ema.buffer_of(span), 1.0 - decay) for ema, decay in zip(self.emas, decays, strict=True)]
            stepped = [entry for entry in stepped if entry[1] is not None]
            with paddle.profiler.RecordEvent("ldm fused adamw + ema"):
                self.flat.kernel.adamw_ema(
                    self.flat.weight(span), self.flat.grad(span), moment1, moment2, [b for _, b, _ in stepped],
                    grad_scale=self.flat.pending_scale,
                    decay_rate=float(lr * lr_ratio * f32(self._weight_decay)) if span.decay else 0.0,
                    beta1=beta1, beta2=beta2, step=float(-(lr * (np.sqrt(f32(1) - b2p) / (f32(1) - b1p)))),
                    eps=float(f32(self._epsilon) * np.sqrt(f32(1) - b2p)),
                    ema_weights=[w for _, _, w in stepped])  # as `lerp_` is given them
            self.flat.zeroed.add(id(span))
            for ema, _, _ in stepped:
                ema.applied[1].add(id(span))
            scale_in_place(pow1, beta1)
            scale_in_place(pow2, beta2)
            self.host_pows[id(span)] = (f32(beta1) * b1p, f32(beta2) * b2p)

    def set_state_dict(self, state_dict):
        self.host_pows = {}
        return super().set_state_dict(state_dict)

    def _clip(self, params_grads, every_span: bool) -> None:
        """The optimizer's own clip (PaddleNLP's Trainer gives it one), in place on the flat gradients.
        `ClipGradByGlobalNorm` over every span: one reduction and one scale per dtype, with its factor
        clip_norm / max(norm, clip_norm). Any other (fleet's hybrid-parallel clip under sharding): its own, its
        results copied back where they are new tensors."""
        clip = self._grad_clip
        if type(clip) is paddle.nn.ClipGradByGlobalNorm and every_span:
            if self.flat.fused:  # the factor on the host, held for the pass
                norm, limit = np.float32(self.flat.fused_norm()), np.float32(clip.clip_norm)
                self.flat.scale(float(limit / np.maximum(norm, limit)))
                return
            norm = self.flat.norm()
            factor = clip.clip_norm / paddle.maximum(norm, paddle.full([], clip.clip_norm, "float32"))
            for grad in self.flat.grads.values():
                grad.multiply_(factor.astype(grad.dtype))
            return
        for (_, grad), (_, clipped) in zip(params_grads, clip(params_grads), strict=True):
            if grad is not None and clipped is not None and clipped.data_ptr() != grad.data_ptr():
                paddle.assign(clipped, output=grad)


class FlatEMA:
    """The EMA's averages as views into one fp32 buffer per span of the flat weights it keeps (`ldm.models.ema.EMA`
    holds them by name as before: its state dict, gathering and swaps are unchanged). The update is one `lerp_` per
    span, shadow + (1 - decay) * (weight - shadow): equal to the per-tensor shadow * decay + weight * (1 - decay) to
    float rounding, and one pass over the bytes (on a 2-core Xeon, 50 M weights: 96 ms against 164-189 ms for
    today's arithmetic over the flat buffer in chunks, and 250-300 ms per tensor; Paddle's `lerp_` is slow only on
    small tensors). `kernel="scale_add"`: today's arithmetic, bit for bit, in chunks of `CHUNK` elements (its
    temporary stays small); weights of another dtype than fp32 always take it."""

    @classmethod
    def adopt(cls, ema, flat: FlatParameters, kernel: str = "lerp") -> None:
        """Lay `ema`'s averages (`ldm.models.ema.EMA`, sharded already) out as `flat`'s weights: its update becomes
        this one."""
        ema.flat = cls(ema, flat, kernel)

    def __init__(self, ema, flat: FlatParameters, kernel: str = "lerp"):
        self.ema, self.flat, self.kernel = ema, flat, kernel
        # `FlatAdamW.fuse`: the optimizer's pass updates the averages of the spans it steps, and leaves here
        # (decay, {id(span)}) for `update` to count and not repeat
        self.applied: tuple[float, set[int]] | None = None
        kept = {id(p): name for name, p in ema.parameters.items() if name in ema.shadow}
        self.spans = [span for span in flat.spans if all(id(p) in kept for p in span.params)]
        whole = {id(span) for span in self.spans}
        if any(id(span) not in whole and any(id(p) in kept for p in span.params) for span in flat.spans):
            raise RuntimeError("the EMA keeps part of a span of the flat weights (its partition differs from the "
                               "optimizer's)")
        self.buffers: list[paddle.Tensor] = []
        freed = FreedMemory()
        with paddle.no_grad():
            for span in self.spans:
                buffer = paddle.empty([span.end - span.start], dtype="float32")
                for p in span.params:
                    name = kept[id(p)]
                    start = flat.offset[id(p)] - span.start
                    view = buffer._slice(start, start + p.size)
                    paddle.assign(ema.shadow[name].reshape([-1]), output=view)
                    view.get_tensor()._set_dims(ema.shadow[name].shape)
                    ema.shadow[name] = view
                    freed.moved_bytes(p.size * 4)
                flat.zero_gaps(buffer, span)
                self.buffers.append(buffer)
        freed.release()

    def buffer_of(self, span: Span) -> paddle.Tensor | None:
        """The flat averages of `span`, if this EMA keeps it and updates with `lerp_` (the fused pass's arithmetic)."""
        if self.kernel != "lerp":
            return None
        return next((buffer for kept, buffer in zip(self.spans, self.buffers, strict=True) if kept is span), None)

    @paddle.no_grad()
    def update(self, decay: float) -> None:
        applied, self.applied = self.applied, None
        if applied is not None and applied[0] != decay:
            raise RuntimeError(f"the fused update stepped the EMA with decay {applied[0]}, its update asks {decay}")
        for span, shadow in zip(self.spans, self.buffers, strict=True):
            if applied is not None and id(span) in applied[1]:
                continue
            weights = self.flat.weight(span)
            if self.kernel == "lerp" and weights.dtype == paddle.float32:
                shadow.lerp_(weights, 1.0 - decay)
                continue
            for start in range(0, shadow.shape[0], CHUNK):
                end = min(start + CHUNK, shadow.shape[0])
                part = shadow._slice(start, end)
                scale_in_place(part, decay)
                chunk = weights._slice(start, end)
                chunk = chunk if chunk.dtype == paddle.float32 else chunk.astype("float32")
                part.add_(chunk * (1.0 - decay))
