"""The flat update (`ldm.train.flat`): the same results as the per-tensor update, parameters that stay views into
the flat buffers through everything that writes them, and Paddle's per-parameter state dict."""

import functools
import json
import os
import shutil

import numpy as np
import paddle
import pytest
from corpus import write_corpus
from entry import checkpoint_state, launch_report, run_entry
from host_memory import MIB, peak_added
from tolerance import UNIT_ROUNDOFF, assert_identical, assert_same_training, training_differences

from ldm.models.ema import EMA
from ldm.train.flat import FlatAdamW, FlatEMA, FreedMemory
from ldm.train.gradients import clip_factor, global_grad_norm, scale_gradients
from ldm.train.native import FusedKernel
from ldm.train.native import load as load_kernel


class Tiny(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 8, 3, padding=1)
        self.norm = paddle.nn.GroupNorm(4, 8)
        self.linear = paddle.nn.Linear(8, 5)
        self.frozen = paddle.nn.Linear(5, 5)
        self.frozen.weight.stop_gradient = self.frozen.bias.stop_gradient = True

    def forward(self, x):
        h = paddle.nn.functional.silu(self.norm(self.conv(x))).mean([2, 3])
        return self.frozen(self.linear(h))


def build(seed=0):
    paddle.seed(seed)
    model = Tiny()
    trained = [p for p in model.parameters() if not p.stop_gradient]
    return model, trained


def batch(i, accumulation=1):
    rng = np.random.default_rng(i)
    return [paddle.to_tensor(rng.normal(size=(2, 3, 6, 6)).astype("float32") * (1 + 3 * (i % 3)))
            for _ in range(accumulation)]


def run(flat: bool, updates: int = 20, *, accumulation: int = 2, max_norm: float = 1.0, skip=(), decay_fun=None,
        fused: bool = False, threads: int | None = None, learning_rate: float = 1e-2):
    """`updates` updates (clip, AdamW, EMA) as the loop makes them, per tensor or flat (its clip, AdamW and EMA in
    one pass of the compiled kernel: `fused`); returns the model and EMA."""
    model, trained = build()
    # a warm-up, as runs have
    schedule = paddle.optimizer.lr.LambdaDecay(learning_rate, lambda step: min(1.0, (step + 1) / 5))
    optimizer = (FlatAdamW if flat else paddle.optimizer.AdamW)(
        schedule, parameters=trained, weight_decay=0.02, apply_decay_param_fun=decay_fun)
    ema = EMA(model, 0.99)
    if flat:
        FlatEMA.adopt(ema, optimizer.flatten())
        assert not fused or optimizer.fuse(fused_kernel(threads), [ema.flat])
    for i in range(updates):
        for x in batch(i, accumulation):
            (model(x) ** 2).mean().backward()
        norm = optimizer.flat.norm() if flat else global_grad_norm(trained)
        factor = float(clip_factor(norm, max_norm))
        if factor < 1:
            optimizer.flat.scale(factor) if flat else scale_gradients(trained, factor)
        # the guard's verdict is a Python bool; an fp16 scaler's a tensor (GradScaler is off on a CPU: set as it does)
        found_inf = i in skip if i % 2 else paddle.to_tensor(i in skip)
        optimizer._set_auxiliary_var("found_inf", found_inf)
        before = model_weights(model) if i in skip else None
        optimizer.step()
        if before is not None:  # skipped whole
            assert all(np.array_equal(w, before[n]) for n, w in model_weights(model).items())
        optimizer.clear_grad()
        if i not in skip:
            ema.update()
            schedule.step()
    return model, ema, optimizer


def model_weights(model):
    return {n: p.numpy() for n, p in model.named_parameters()}


def shadows(ema):
    return {n: t.numpy() for n, t in ema.shadow.items()}


def fused_kernel(threads: int | None = None):
    kernel, why = load_kernel()
    assert kernel is not None, why  # every machine of the suite has a C compiler
    return FusedKernel(kernel.library, threads) if threads else kernel


@pytest.mark.parametrize("fused", [False, True])
def test_flat_update_equals_the_per_tensor_update_over_20_updates(fused):
    per_tensor, ema_a, opt_a = run(False, skip=(7, 12))
    flat, ema_b, opt_b = run(True, skip=(7, 12), fused=fused)
    same = functools.partial(assert_same_training, learning_rate=1e-2, updates=20)
    same(model_weights(flat), model_weights(per_tensor))
    same(shadows(ema_b), shadows(ema_a))
    # Paddle's names, per parameter, with their shapes: checkpoints unchanged on disk
    same(by_structured_name(opt_b, flat), by_structured_name(opt_a, per_tensor))


def test_the_bound_between_two_forms_tells_a_learning_rate_one_percent_off():
    """tests/tolerance.py's bound is not vacuous: the same updates at a learning rate 1 % higher end outside it."""
    per_tensor, _, _ = run(False, skip=(7, 12))
    off, _, _ = run(True, skip=(7, 12), learning_rate=1.01e-2)
    assert max(training_differences(model_weights(off), model_weights(per_tensor), 1e-2, 20).values()) > 2


def test_the_fused_update_is_the_same_to_the_bit_on_any_number_of_threads():
    """Each parameter's sum of squares is one thread's, added up in the model's order, and the pass is element by
    element: a run resumed with more or fewer threads (processes on a node) goes on as it would have."""
    results = [run(True, 6, skip=(3,), fused=True, threads=threads) for threads in (1, 2, 3)]
    for model, ema, _ in results[1:]:
        assert_identical(model_weights(model), model_weights(results[0][0]))
        assert_identical(shadows(ema), shadows(results[0][1]))


def by_structured_name(optimizer, model) -> dict:
    """The optimizer's state keyed by the model's names instead of Paddle's counters (two models in one process)."""
    names = {p.name: n for n, p in model.named_parameters()}
    state = {}
    for key, value in optimizer.state_dict().items():
        if key != "LR_Scheduler":
            pname = max((p for p in names if key.startswith(p + "_")), key=len)
            state[names[pname] + key[len(pname):]] = value.numpy()
    return state


def test_a_save_reads_a_flat_parameter_where_it_lies_not_through_a_copy_of_its_whole_buffer():
    """Paddle's `numpy()` of a view copies the whole buffer it lies in: a save of ldm-12layer (846 views of a 3.7 GB
    buffer) took minutes per checkpoint and a buffer's size more memory. The writer reads each view in place."""
    from ldm.checkpoint.serialization import LiveTensor, host_array
    from ldm.train.flat import FlatParameters

    layer = paddle.nn.Sequential(paddle.nn.Linear(64, 32), paddle.nn.Linear(32, 16))
    parameters = list(layer.parameters())
    before = [p.numpy().copy() for p in parameters]
    flat = FlatParameters(parameters)
    buffer = np.from_dlpack(next(iter(flat.weights.values())))
    for parameter, values in zip(parameters, before, strict=True):
        array = host_array(parameter)
        np.testing.assert_array_equal(array, values)
        assert np.shares_memory(array, buffer) and array.size == values.size  # the view alone, in place
        np.testing.assert_array_equal(LiveTensor(parameter).array(), values)


@pytest.mark.parametrize("flat", [True, False])
def test_the_moments_are_freed_when_the_updates_are_over(flat):
    """Before the end-of-run export: ldm-12layer's 7 GB of moments beside the model it loads passed 22 GiB."""
    from ldm.train.flat import FlatAdamW
    from ldm.train.gradients import release_optimizer_state

    layer = paddle.nn.Linear(64, 32)
    optimizer = (FlatAdamW if flat else paddle.optimizer.AdamW)(1e-3, parameters=layer.parameters())
    if flat:
        optimizer.flatten()
    layer(paddle.randn([4, 64])).mean().backward()
    optimizer.step()
    held = [t for accumulators in optimizer._accumulators.values() for t in accumulators.values()]
    assert any(int(t.size) == 64 * 32 for t in held)  # the moments of the weight
    release_optimizer_state(optimizer)
    assert not any(optimizer._accumulators.values()) and not getattr(optimizer, "moments", {})


def test_the_update_is_built_once_and_says_the_form_it_built():
    """`build_update` returns what runs, which the run's record says: a fused pass asked for over weights it cannot
    step (fp64: it steps fp32) is the flat form; an optimizer that is no FlatAdamW steps per tensor. Every form
    answers the loop's calls alike, and the Trainer's AdamW becomes a FlatAdamW of its own settings (a new object,
    not its class)."""
    from ldm.train.update import build_update

    def built(optimizer, layer, requested):
        ema = EMA(layer)
        update = build_update(requested, optimizer, list(layer.parameters()), [ema])
        layer(paddle.ones([2, 8], dtype=layer.weight.dtype)).sum().backward()
        norm = float(update.norm())
        update.clip(0.5)
        assert float(update.norm()) == pytest.approx(norm / 2, rel=4 * UNIT_ROUNDOFF)
        update.step(paddle.amp.GradScaler(enable=False))
        update.clear()
        assert float(update.norm()) == 0
        return update

    layer = paddle.nn.Linear(8, 4)
    layer.to(dtype="float64")
    update = built(FlatAdamW(1e-3, parameters=layer.parameters()), layer, "fused")
    assert update.form == "flat" and not update.gradients.broken_views()
    layer = paddle.nn.Linear(8, 4)
    assert built(paddle.optimizer.AdamW(1e-3, parameters=layer.parameters()), layer, "fused").form == "per_tensor"
    layer = paddle.nn.Linear(8, 4)
    assert built(FlatAdamW(1e-3, parameters=layer.parameters()), layer, None).form == "per_tensor"

    rule = lambda name: name.endswith(".w_0")  # noqa: E731 - PaddleNLP's kind of rule
    given = paddle.optimizer.AdamW(1e-3, parameters=layer.parameters(), weight_decay=0.02, beta1=0.8,
                                   apply_decay_param_fun=rule, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))
    flat = FlatAdamW.like(given)
    assert type(flat) is FlatAdamW and type(given) is paddle.optimizer.AdamW
    assert (flat._weight_decay, flat._beta1, flat._apply_decay_param_fun, flat._grad_clip) == (
        0.02, 0.8, rule, given._grad_clip) and flat._parameter_list == given._parameter_list


def test_decay_excluded_parameters_form_their_own_span():
    rule = lambda name: name.endswith(".w_0") and "norm" not in name  # noqa: E731 - PaddleNLP's: no bias, no norm
    per_tensor, _, _ = run(False, 6, decay_fun=rule)
    flat, _, optimizer = run(True, 6, decay_fun=rule)
    assert_same_training(model_weights(flat), model_weights(per_tensor), learning_rate=1e-2, updates=6)
    assert sorted(span.decay for span in optimizer.flat.spans) == [False, True]


def test_parameters_stay_views_through_loads_swaps_and_gradient_accumulation():
    model, ema, optimizer = run(True, 3)
    flat = optimizer.flat
    assert not flat.broken_views()
    assert all(p._is_shared_buffer_with(flat.weights["paddle.float32"]) for p in flat.parameters)
    # writes through every path a run uses
    model.set_state_dict({n: np.full(p.shape, 0.5, "float32") for n, p in model.named_parameters()})
    assert float(flat.weights["paddle.float32"].max()) == 0.5  # (the alignment gaps: zero)
    with ema.swapped(model):
        assert not flat.broken_views()
    optimizer.set_state_dict(optimizer.state_dict())
    ema.load_state_dict({k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in ema.state_dict().items()})
    assert not flat.broken_views()
    assert all(t._is_shared_buffer_with(ema.flat.buffers[0]) for t in ema.shadow.values())
    # an in-place edit of the flat buffer is an edit of the parameter, and back
    flat.weights["paddle.float32"].scale_(2.0)
    assert float(model.conv.weight.min()) == 1.0
    # accumulation writes into the flat gradient buffer
    for x in batch(0, 2):
        (model(x) ** 2).mean().backward()
    total = float((flat.grads["paddle.float32"] ** 2).sum())
    # two float sums of the same non-negative squares, each within (n - 1) roundings of the exact one
    n = sum(int(p.grad.size) for p in flat.parameters)
    per_parameter = sum(float((p.grad ** 2).sum()) for p in flat.parameters)
    assert total > 0 and abs(total - per_parameter) < 2 * n * UNIT_ROUNDOFF * total
    # Paddle's clear_gradient detaches a gradient: the next step finds it and copies it back in
    model.linear.weight.clear_gradient(False)
    (model(batch(1)[0]) ** 2).mean().backward()
    assert flat.broken_views()
    optimizer.step()
    assert not flat.broken_views() and flat.reattached > 0


@pytest.mark.parametrize("flat_first", [True, False])
def test_state_dicts_cross_between_the_two_forms(flat_first):
    """A checkpoint of either form resumes in the other: the same keys, shapes and values, and the same updates."""
    source, source_ema, source_opt = run(flat_first, 5)
    weights_state = {n: p.numpy() for n, p in source.named_parameters()}
    opt_state = by_structured_name(source_opt, source)
    ema_state = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in source_ema.state_dict().items()}

    def resumed(flat):
        model, trained = build(seed=1)
        optimizer = (FlatAdamW if flat else paddle.optimizer.AdamW)(1e-2, parameters=trained, weight_decay=0.02)
        ema = EMA(model, 0.99)
        if flat:
            FlatEMA.adopt(ema, optimizer.flatten())
        model.set_state_dict(weights_state)
        pnames = {n: p.name for n, p in model.named_parameters()}
        state = {}
        for key, value in opt_state.items():  # Paddle's names of this process's parameters
            name = max((n for n in pnames if key.startswith(n + "_")), key=len)
            state[pnames[name] + key[len(name):]] = paddle.to_tensor(value)
        optimizer.set_state_dict(state)
        ema.load_state_dict(ema_state)
        for i in range(5, 9):
            (model(batch(i)[0]) ** 2).mean().backward()
            optimizer.step()
            optimizer.clear_grad()
            ema.update()
        if flat:
            assert not optimizer.flat.broken_views()
        return model_weights(model), shadows(ema)

    a, b = resumed(not flat_first), resumed(flat_first)
    assert_same_training(a[0], b[0], learning_rate=1e-2, updates=4)
    assert_same_training(a[1], b[1], learning_rate=1e-2, updates=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab_dir):
    folder = tmp_path_factory.mktemp("flat_corpus")
    listing = write_corpus(str(folder), num_records=24, records_per_shard=8, kinds=("jpeg",))
    return ["--pretrained_model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--file_list", listing,
            "--tokenizer_name", vocab_dir, "--model_max_length", "16", "--resolution", "32", "--train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--save_steps", "2", "--num_workers", "0", "--learning_rate", "1e-3",
            "--max_grad_norm", "0.05", "--use_ema", "--report_to", "none", "--progress", "none", "--seed", "3"]


def loop_checkpoint(corpus, out, updates: int, flat: str, *extra, launch: bool = False) -> str:
    """`updates` updates of the loop, on 1 process or 2 (`launch`, logs under `out`'s parent); its last checkpoint."""
    result = run_entry("train_txt2img_laion400m_no_trainer.py",
                       corpus + ["--max_train_steps", str(updates), "--flat_update", flat, "--output_dir", str(out),
                                 *extra], launch=launch, cwd=out.parent if launch else None)
    assert result.returncode == 0, launch_report(result, out.parent) if launch else result.stderr[-3000:]
    if not launch:
        assert ("flat update: " in result.stderr) == (flat != "off")
        assert ("one fused pass" in result.stderr) == (flat == "fused")
        ran = {"fused": "fused", "on": "flat", "off": "per_tensor"}[flat]
        with open(out / "run.json") as f:  # the form that ran, beside the one asked for (a resume keeps the first's)
            assert "--resume_from_checkpoint" in extra or json.load(f)["world"]["update"] == ran
    return os.path.join(out, f"checkpoint-{updates}")


@pytest.mark.slow
def test_the_loop_flat_or_per_tensor_ends_alike_and_resumes_across_the_change(corpus, tmp_path):
    """The entry point with --flat_update fused (a CPU's default) and off: the same weights, EMA and AdamW state
    (Paddle's names and shapes) after 4 clipped updates, and a checkpoint of either form resumed by the other ends
    the same."""
    flat = loop_checkpoint(corpus, tmp_path / "flat", 4, "fused")
    per_tensor = loop_checkpoint(corpus, tmp_path / "per_tensor", 4, "off")
    expected = checkpoint_state(per_tensor)
    # the fused form's global norm adds each parameter's sum in double, Paddle's per-tensor one in float: a clip
    # factor one rounding apart, which the next updates' gradients carry (tests/tolerance.py)
    assert_same_training(checkpoint_state(flat), expected, learning_rate=1e-3, updates=4)
    for source, form in ((flat, "off"), (per_tensor, "fused")):
        out = tmp_path / f"resumed-{form}"
        shutil.copytree(os.path.dirname(source), out, ignore=shutil.ignore_patterns("checkpoint-4", "pipeline"))
        resumed = loop_checkpoint(corpus, out, 4, form, "--resume_from_checkpoint", "latest")
        assert_same_training(checkpoint_state(resumed), expected, learning_rate=1e-3, updates=4)


@pytest.mark.slow
def test_the_trainer_path_flat_or_per_tensor_ends_alike(corpus, tmp_path, vocab_dir):
    """PaddleNLP's Trainer makes its own AdamW (biases and norms undecayed, its global-norm clip): flat, it ends
    3 updates where the per-tensor one does, fused (its clip's factor carried into the pass) or not."""
    common = corpus[corpus.index("--file_list"):corpus.index("--model_max_length")] + [
        "--do_train", "--model_name_or_path", "ldm-tiny", "--allow_untrained_vae", "--model_max_length", "16",
        "--resolution", "32", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--max_steps", "3", "--save_steps", "3", "--learning_rate", "1e-3", "--weight_decay", "0.02",
        "--max_grad_norm", "0.05", "--use_ema", "--seed", "3", "--report_to", "none"]
    states = {}
    for flat in ("fused", "on", "off"):
        result = run_entry("train_txt2img_laion400m_trainer.py",
                           common + ["--flat_update", flat, "--output_dir", str(tmp_path / flat)])
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("in 2 spans" in result.stderr) == (flat != "off")  # decayed and undecayed
        assert ("one fused pass" in result.stderr) == (flat == "fused")
        with open(tmp_path / flat / "run.json") as f:  # built after the first write: the record amended
            assert json.load(f)["world"]["update"] == {"fused": "fused", "on": "flat", "off": "per_tensor"}[flat]
        states[flat] = checkpoint_state(tmp_path / flat / "checkpoint-3")
    assert_same_training(states["fused"], states["off"], learning_rate=1e-3, updates=3)
    assert_same_training(states["on"], states["off"], learning_rate=1e-3, updates=3)


def test_laying_out_flat_never_holds_the_weights_gradients_moments_or_ema_twice():
    """64 MiB of weights (and as much gradient, moments and EMA) moved into flat buffers: the peak stays within the
    memory handed back every `FreedMemory.every` bytes moved (32 MiB) above what was resident, where keeping the
    moved tensors would add all they weigh."""
    paddle.seed(0)
    layers = paddle.nn.LayerList([paddle.nn.Linear(512, 512) for _ in range(64)])
    (sum(layer(paddle.ones([1, 512])).sum() for layer in layers)).backward()
    trained = list(layers.parameters())
    optimizer = FlatAdamW(1e-3, parameters=trained)
    ema = EMA(layers)
    size, slack = sum(p.size for p in trained) * 4, FreedMemory().every + 4 * MIB
    flat, added = peak_added(optimizer.flatten)  # weights and gradients: 2 x 64 MiB moved
    assert added < slack, added / MIB
    _, added = peak_added(FlatEMA.adopt, ema, flat)
    assert added < slack, added / MIB
    _, added = peak_added(optimizer.step)  # the moments (2 x 64 MiB more): Paddle's per tensor, each moved at once
    assert added < 2 * size + slack, added / MIB


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_flat_or_per_tensor_end_alike(corpus, tmp_path, monkeypatch):
    """Under DDP the flat gradients are all-reduced as one buffer: 2 updates on 2 ranks end where the per-tensor
    form's fused all-reduce does, even with every matrix product of the per-tensor run rounded as on another kind of
    CPU (MKL's SSE2 code path, `MKL_CBWR=COMPATIBLE`, read by each rank at its first product): a tolerance tuned on
    one CPU fails here on any (docs/numerics.md)."""
    states = {}
    for flat in ("on", "off"):
        if flat == "off":
            monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
        states[flat] = checkpoint_state(loop_checkpoint(corpus, tmp_path / flat, 2, flat, launch=True))
    assert any(not np.array_equal(states["on"][k], states["off"][k]) for k in states["on"])  # another rounding
    assert_same_training(states["on"], states["off"], learning_rate=1e-3, updates=2)


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A machine whose C compiler fails (an empty kernel cache, `$CC` that exits 1)."""
    monkeypatch.setenv("LDM_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "/bin/false")
    load_kernel.cache_clear()
    yield
    load_kernel.cache_clear()


def test_without_a_compiler_auto_runs_paddles_kernels_and_fused_is_refused_in_one_line(corpus, tmp_path,
                                                                                       no_compiler):
    kernel, why = load_kernel()
    assert kernel is None and why == "/bin/false failed (exit code 1)" and not os.listdir(tmp_path / "kernels")
    result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
        "--max_train_steps", "1", "--flat_update", "fused", "--output_dir", str(tmp_path / "run")])
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].endswith("--flat_update fused: /bin/false failed (exit code 1)")
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
    result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
        "--max_train_steps", "1", "--output_dir", str(tmp_path / "run")])  # auto, the retry
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flat update: Paddle's kernels, not the fused one (/bin/false failed" in result.stderr
    assert "flat update: " in result.stderr and "one fused pass" not in result.stderr


def test_the_kernel_is_compiled_once_and_then_loaded_from_its_cache_without_a_compiler(tmp_path, monkeypatch):
    """Compiled once into the cache; a damaged library there is built again; a cached one loads with no compiler
    on the PATH. (Each check in a process of its own: a process keeps the library it loaded.)"""
    import subprocess
    import sys

    def loads(**env) -> str:
        code = "from ldm.train.native import load; kernel, why = load(); print('loaded' if kernel else why)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LDM_KERNEL_CACHE": str(tmp_path), **env})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert loads() == "loaded"
    built = os.listdir(tmp_path)  # named by its source, command and machine, and its own digest; no partial file
    assert len(built) == 1 and built[0].startswith("flat_update-") and built[0].endswith(".so")
    library = tmp_path / built[0]
    whole = library.read_bytes()
    for damaged in (whole[:5000], b"not a library"):  # a truncated library crashed the dynamic loader
        (tmp_path / "damaged").write_bytes(damaged)
        os.replace(tmp_path / "damaged", library)
        assert loads() == "loaded" and os.listdir(tmp_path) == built and library.read_bytes() == whole
    assert library.stat().st_mode & 0o777 == 0o755  # other users of a shared cache load it too
    assert loads(PATH="") == "loaded" and os.listdir(tmp_path) == built
    monkeypatch.setenv("LDM_KERNEL_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", "")
    load_kernel.cache_clear()
    try:
        assert load_kernel() == (None, "no C compiler (cc; $CC names another) on the PATH")
    finally:
        load_kernel.cache_clear()


def kernel_with_other_arithmetic(folder) -> FusedKernel:
    """The kernel built to round as the other kind of CPU's Paddle does: with fused multiply-adds where this one's
    Paddle has none, in the reference loop's order where it has them (its JIT kernel on an AVX-512 CPU)."""
    import ctypes

    from ldm.train.native import FLAGS, arithmetic_flags, cached, compile_into

    other = ["-mavx2"] if "-DLDM_FMA" in arithmetic_flags() else ["-mavx2", "-mfma", "-DLDM_FMA"]
    stem = str(folder / "other")
    assert compile_into(["cc", *FLAGS, *other], stem) == ""
    return FusedKernel(ctypes.CDLL(cached(stem)[0]), 1)


# Paddle's adamw_ runs its Adam kernel for an undecayed span
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("arithmetic", ["this machine's", "the other kind's"])
def test_the_pass_is_paddles_adamw_and_lerp_and_its_norm_the_same_on_any_threads(decay, arithmetic, tmp_path):
    """The kernel against Paddle's own CPU kernels on one buffer of 100 000 weights with tiny and large gradients,
    three steps: to the bit where Paddle runs its AVX-512 JIT kernel (which the pass follows), else within the
    roundings of the arithmetic done in another order; each segment's sum of squares the same on 1, 2 and 3
    threads. The kernel built for the other kind of CPU (fused multiply-adds or not) checks that bound on any
    machine."""
    from ldm.runtime.cpu import cpu_identity

    kernel, n = fused_kernel() if arithmetic == "this machine's" else kernel_with_other_arithmetic(tmp_path), 100_000
    rng = np.random.default_rng(0)
    # p, g, m1, m2 and two averages (the EMA and a post-hoc EMA's profile, stepped in the one pass)
    values = [rng.normal(size=n).astype("float32") * s for s in (1e-3, 1.0, 0.0, 0.0, 1e-3, 1e-3)]
    values[1][: n // 2] *= 1e-9
    mine = [paddle.to_tensor(v) for v in values]
    paddles = [paddle.to_tensor(v) for v in values]
    pow1, pow2, lr, f32 = paddle.full([1], 0.9), paddle.full([1], 0.999), paddle.full([1], 1e-3), np.float32
    steps = 3
    for _ in range(steps):
        b1p, b2p = f32(pow1.item()), f32(pow2.item())
        p, g, m1, m2, ema, profile = paddles
        paddle._C_ops.adamw_(p, g, lr, m1, m2, None, pow1.clone(), pow2.clone(), None, None, 0.9, 0.999, 1e-8,
                             1.0, 0.01, decay, False, 1000, False, False, False)
        ema.lerp_(p, 1.0 - 0.99)
        profile.lerp_(p, 1.0 - 0.7)
        kernel.adamw_ema(*mine[:4], mine[4:], grad_scale=1.0,
                         decay_rate=float(f32(1e-3) * f32(1) * f32(0.01)) * decay, beta1=0.9, beta2=0.999,
                         step=float(-(f32(1e-3) * (np.sqrt(f32(1) - b2p) / (f32(1) - b1p)))),
                         eps=float(f32(1e-8) * np.sqrt(f32(1) - b2p)), ema_weights=[1.0 - 0.99, 1.0 - 0.7])
        assert not mine[1].numpy().any()  # the gradient zeroed once read
        paddle.assign(paddle.to_tensor(values[1]), output=mine[1])
        pow1, pow2 = pow1 * 0.9, pow2 * 0.999
    exact = arithmetic == "this machine's" and "avx512f" in cpu_identity()[1]
    for name, a, b in zip(("weights", "moment1", "moment2", "ema", "profile"), (mine[0], *mine[2:]),
                          (paddles[0], *paddles[2:]), strict=True):
        a, b = a.numpy().astype(np.float64), b.numpy()
        # Same inputs, the same operations in another order or fused: each step rounds each value about 8 times
        # (moments, square root, ε, division, learning rate, decay, subtraction, lerp), 16 allowed. A weight's step
        # is at most the learning rate in size (|m̂ / (√v̂ + ε)| ≤ 1 here: the same gradient every step).
        size = np.abs(b) + (1e-3 if name in ("weights", "ema", "profile") else 0.0)
        assert np.array_equal(a, b) if exact else (np.abs(a - b) <= steps * 16 * UNIT_ROUNDOFF * size).all(), name
    starts, sizes = np.array([0, 10, 5000, 40_000]), np.array([10, 4990, 35_000, 60_000])
    sums = [FusedKernel(kernel.library, threads).sum_squares(mine[0], starts, sizes) for threads in (1, 2, 3)]
    assert all(np.array_equal(s, sums[0]) for s in sums[1:])
    weights = mine[0].numpy().astype(np.float64)
    expected = [np.sum(weights[a:a + k] ** 2) for a, k in zip(starts, sizes, strict=True)]
    # non-negative squares added in float within runs of 4096 (csrc/flat_update.c), the runs in double
    assert np.allclose(sums[0], expected, rtol=4096 * UNIT_ROUNDOFF, atol=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_agree_on_the_form_when_the_kernel_builds_on_one_only(corpus, tmp_path, monkeypatch):
    """Replicas step by one arithmetic: where rank 1's compiler fails, both ranks take Paddle's kernels (said once);
    asked for the fused pass, both refuse in one line naming the rank."""
    compiler = tmp_path / "cc-on-rank-0"
    compiler.write_text('#!/bin/sh\n[ "$PADDLE_TRAINER_ID" = 1 ] && exit 1\nsleep 2\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LDM_KERNEL_CACHE", str(tmp_path / "kernels"))  # empty: rank 1 fails before rank 0 builds
    load_kernel.cache_clear()
    try:
        loop_checkpoint(corpus, tmp_path / "auto", 2, "auto", launch=True)
        logs = {rank: (tmp_path / "launch_logs" / f"workerlog.{rank}").read_text() for rank in (0, 1)}
        assert "the fused kernel did not build on rank(s) 1" in logs[0]
        assert "trained tensors in 1 spans\n" in logs[0] and all("one fused pass" not in log for log in logs.values())
        for folder in (tmp_path / "kernels", tmp_path / "launch_logs"):
            shutil.rmtree(folder)
        result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
            "--max_train_steps", "2", "--flat_update", "fused", "--output_dir", str(tmp_path / "fused")],
            launch=True, cwd=tmp_path)
        assert result.returncode != 0
        said = (tmp_path / "launch_logs" / "workerlog.0").read_text().strip().splitlines()[-1]
        assert said.endswith("--flat_update fused: " + str(compiler) + " failed (exit code 1) (rank 1)"), said
    finally:
        load_kernel.cache_clear()


@pytest.mark.parametrize("threads", ["abc", "0", "²", "1025", "100000"])
def test_a_thread_count_out_of_reason_is_one_line(monkeypatch, threads):
    from ldm.runtime.device import DeviceError
    from ldm.train.native import update_threads

    monkeypatch.setenv("LDM_UPDATE_THREADS", threads)
    with pytest.raises(DeviceError, match="LDM_UPDATE_THREADS must be a whole number of threads from 1 to 1024"):
        update_threads()


def test_a_cc_that_is_no_command_falls_back_with_its_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", 'gcc "-O2')
    monkeypatch.setenv("LDM_KERNEL_CACHE", str(tmp_path))
    load_kernel.cache_clear()
    try:
        assert load_kernel() == (None, "$CC is not a command (No closing quotation)")
    finally:
        load_kernel.cache_clear()


def load_in_a_process(cache, **env) -> str:
    """`ldm.train.native.load()` in a new process (a process keeps the library it loaded): "loaded", or why not."""
    import subprocess
    import sys

    code = "from ldm.train.native import load; kernel, why = load(); print('loaded' if kernel else why)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "LDM_KERNEL_CACHE": str(cache), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def libraries(cache) -> list[str]:
    return sorted(name for name in os.listdir(cache) if name.endswith(".so"))


def test_the_kernel_cache_tells_compilers_apart_and_rebuilds_once_what_does_not_load_here(tmp_path):
    """Two compilers under one name (`cc`, two releases) build two libraries. A library under the right name that
    needs a shared object this node lacks (built on another node of a shared home) is built again once, under a name
    that holds this node's, and that one loads from then on."""
    import subprocess

    cache, other = tmp_path / "kernels", tmp_path / "other-release"
    assert load_in_a_process(cache) == "loaded"
    (ours,) = libraries(cache)
    other.mkdir()  # the same compiler, saying it is another release
    (other / "cc").write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "cc (Other) 99.1"; exit 0; }}\n'
                              f'exec {shutil.which("cc")} "$@"\n')
    (other / "cc").chmod(0o755)
    assert load_in_a_process(cache, PATH=f"{other}:{os.environ['PATH']}") == "loaded"
    assert len(libraries(cache)) == 2

    # a library that needs libgone.so, which this node does not have, put where `ours` was
    build = tmp_path / "build"
    build.mkdir()
    (build / "gone.c").write_text("int ldm_gone(void) { return 1; }\n")
    (build / "needs.c").write_text("int ldm_gone(void);\nint ldm_needs(void) { return ldm_gone(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(build / "libgone.so"), str(build / "gone.c")], check=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(build / "needs.so"), str(build / "needs.c"), "-L", str(build),
                    "-lgone"], check=True)
    from ldm.train.native import digest

    foreign = cache / f"{ours.rpartition('-')[0]}-{digest(build / 'needs.so')}.so"
    shutil.copy(build / "needs.so", foreign)
    os.unlink(cache / ours)
    before = set(libraries(cache))
    assert load_in_a_process(cache) == "loaded"
    (mine,) = set(libraries(cache)) - before  # built for this node; the foreign one stays for the nodes it suits
    assert foreign.exists() and mine != foreign.name
    assert load_in_a_process(cache) == "loaded" and set(libraries(cache)) == before | {mine}  # not built again


def test_a_compiler_that_writes_nothing_and_a_killed_compile_leave_nothing_that_blocks_the_cache(tmp_path):
    """`CC=/bin/true` exits 0 and writes no library: said, and nothing cached (a 0-byte library failed "file too
    short" forever). A compile killed midway leaves its partial output, removed by the next compile on this node
    once its process is gone; another node's, once it is older than any compile."""
    import signal
    import subprocess
    import sys
    import time

    cache = tmp_path / "kernels"
    for _ in range(2):
        assert load_in_a_process(cache, CC="/bin/true") == "/bin/true made no shared library (exit code 0, 0 bytes " \
                                                           "written)"
    assert libraries(cache) == [] and not list(cache.glob("*.partial"))

    slow = tmp_path / "slow-cc"
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] || [ "$1" = -dumpmachine ] || sleep 600\n'
                    f'exec {shutil.which("cc")} "$@"\n')
    slow.chmod(0o755)
    code = "from ldm.train.native import load; load()"
    compiling = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                 env={**os.environ, "LDM_KERNEL_CACHE": str(cache), "CC": str(slow)})
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob("*.so.partial")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(compiling.pid, signal.SIGKILL)
        compiling.wait()
    (killed,) = cache.glob("*.so.partial")
    elsewhere = [cache / f"flat_update-0.4242@another-node.x{age}.so.partial" for age in ("old", "new")]
    for path in elsewhere:
        path.write_bytes(b"")
    os.utime(elsewhere[0], (time.time() - 3600, time.time() - 3600))
    assert load_in_a_process(cache, CC=str(slow).replace("slow-cc", "missing-cc")) == (
        f"no C compiler ({tmp_path / 'missing-cc'}; $CC names another) on the PATH")  # no compile, nothing removed
    assert killed.exists()
    assert load_in_a_process(cache) == "loaded"
    assert sorted(cache.glob("*.so.partial")) == [elsewhere[1]]


@pytest.mark.parametrize("form", ["off", "on", "auto", "fused"])
def test_a_thread_count_out_of_reason_refuses_every_form_alike(corpus, tmp_path, monkeypatch, form):
    """`LDM_UPDATE_THREADS=0` was refused under auto and fused only (off and on never read it): every form checks it
    at the start, in one line, before anything is written."""
    monkeypatch.setenv("LDM_UPDATE_THREADS", "0")
    result = run_entry("train_txt2img_laion400m_no_trainer.py", corpus + [
        "--max_train_steps", "1", "--flat_update", form, "--output_dir", str(tmp_path / "run")])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: LDM_UPDATE_THREADS must be a whole number of threads from 1 to 1024, not '0'"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
