"""The update around the step, per tensor (`--flat_update off`: `ldm.train.gradients` clip, Paddle's AdamW,
`ldm.models.ema.EMA`) against flat (`on`, `ldm.train.flat`: one reduction, one `adamw_` per span, one EMA pass over
flat buffers) and fused (`fused`, a CPU's default: the norm, then the clip's factor, AdamW and the EMA in one pass of
`ldm.train.native`'s kernel on the process's share of the cores; `fused@N`: on N threads).

    .venv/bin/python scripts/bench_update.py [--width 64 --text_layers 2] [--rounds 7]     # about 50 M weights
    .venv/bin/python scripts/bench_update.py --width 320 --text_layers 12 --rounds 3 --memory   # ldm-12layer
    .venv/bin/python scripts/bench_update.py --forms per_tensor flat fused fused@1   # the kernel on one thread too
    .venv/bin/python scripts/bench_update.py --ema_profiles 2     # with the post-hoc EMA's two profiles too

The model is the 12-layer preset (`ldm-12layer`: UNet and LDMBert, a 64-token vocabulary, 16 positions) with the
UNet's channels cut to --width and LDMBert cut to --text_layers (320 and 12: the preset itself); one backward pass
of batch 1 at 32 px (4 x 4 latents) makes the gradients, which are then refilled with noise before each round (not
timed). Timed per update, as the loop makes it: the global norm, the clip factor's read and the rescaling
(--max_grad_norm small enough that it clips), the AdamW step and the gradients' clearing, the EMA. In one process
(default) both forms run on two copies of the model, interleaved round by round; medians and the ratio flat / per
tensor are printed last, with Paddle's operator calls per update counted by its profiler (the fused pass is one call
that the profiler does not see). `--memory` runs each form
alone in a process of its own instead (as a run holds one), and prints its peak resident memory (VmHWM) beside its
times: the flat buffers must not hold a second copy of anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = ("clip", "optimizer", "ema")


def build(width: int, text_layers: int, seed: int = 0):
    """The 12-layer preset's UNet (channels cut to `width`) and LDMBert (`text_layers` layers), seeded, with
    gradients from one backward."""
    import paddle
    from ppdiffusers import UNet2DConditionModel

    from ldm.models.build import load_part, load_text_encoder

    preset = os.path.join(ROOT, "ldm", "models", "presets", "ldm-12layer")
    with tempfile.TemporaryDirectory() as folder:
        for part, key, value in (("unet", "block_out_channels", [width, 2 * width, 4 * width, 4 * width]),
                                 ("bert", "encoder_layers", text_layers)):
            shutil.copytree(os.path.join(preset, part), os.path.join(folder, part))
            path = os.path.join(folder, part, "config.json")
            with open(path) as f:
                config = json.load(f)
            config[key] = value
            with open(path, "w") as f:
                json.dump(config, f)
        paddle.seed(seed)
        unet, _ = load_part(UNet2DConditionModel, os.path.join(folder, "unet"))
        text_encoder, _ = load_text_encoder(os.path.join(folder, "bert"), vocab_size=64, max_length=16)

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.unet, self.text_encoder = unet, text_encoder

    model = Model()
    ids = paddle.randint(1, 64, [1, 16])
    latents = paddle.randn([1, unet.config.in_channels, 4, 4])
    (unet(latents, paddle.to_tensor([500]), encoder_hidden_states=text_encoder(ids)[0]).sample ** 2).mean().backward()
    return model


class Form:
    """One form of the update over `model`: "per_tensor" (`--flat_update off`), "flat" (`on`), "fused" or "fused@N"
    (N threads)."""

    def __init__(self, model, name: str, max_norm: float, profiles: int = 0):
        import paddle

        from ldm.models.ema import EMA
        from ldm.models.posthoc_ema import EMAProfiles
        from ldm.train.flat import FlatAdamW, FlatEMA
        from ldm.train.native import FusedKernel, load

        flat = name != "per_tensor"
        self.model, self.flat, self.max_norm = model, flat, max_norm
        # what the backward reached (Paddle's AdamW steps nothing else; the flat form would decay it)
        self.trained = [p for p in model.parameters() if not p.stop_gradient and p.grad is not None]
        for p in model.parameters():
            p.stop_gradient = p.stop_gradient or p.grad is None
        self.optimizer = (FlatAdamW if flat else paddle.optimizer.AdamW)(1e-6, parameters=self.trained,
                                                                          weight_decay=0.02)
        self.ema = EMA(model)
        self.profiles = EMAProfiles(model, (0.05, 0.10, 0.15, 0.2)[:profiles])  # `--ema_sigma_rels`
        averages = [self.ema, *self.profiles.profiles]
        if flat:
            flat_weights = self.optimizer.flatten()
            for ema in averages:
                FlatEMA.adopt(ema, flat_weights)
        if name.startswith("fused"):
            kernel, why = load()
            if kernel is None:
                sys.exit(f"the fused kernel: {why}")
            threads = int(name.split("@")[1]) if "@" in name else kernel.threads
            assert self.optimizer.fuse(FusedKernel(kernel.library, threads), [ema.flat for ema in averages])
        self.clipped = False

    def refill(self, seed: int) -> None:
        """Noise for gradients, in place (not timed): what a backward pass leaves."""
        import paddle

        paddle.seed(seed)
        with paddle.no_grad():
            if self.flat:
                for grad in self.optimizer.flat.grads.values():
                    grad.uniform_(-1e-3, 1e-3)
            else:
                for p in self.trained:
                    p.grad_.uniform_(-1e-3, 1e-3)

    def update(self) -> dict[str, float]:
        from ldm.train.gradients import clip_factor, global_grad_norm, scale_gradients

        times, start = {}, time.perf_counter()
        norm = self.optimizer.flat.norm() if self.flat else global_grad_norm(self.trained)
        factor = float(clip_factor(norm, self.max_norm))  # the vote's read
        if factor < 1:
            self.clipped = True
            self.optimizer.flat.scale(factor) if self.flat else scale_gradients(self.trained, factor)
        times["clip"], start = time.perf_counter() - start, time.perf_counter()
        self.optimizer.step()
        self.optimizer.clear_grad()
        times["optimizer"], start = time.perf_counter() - start, time.perf_counter()
        self.ema.update()
        self.profiles.updated(False)
        times["ema"] = time.perf_counter() - start
        return times


def operator_calls(form: Form) -> int | None:
    """Paddle operators one update runs (its profiler's host events of type Operator), or None if it cannot say."""
    try:
        import paddle.profiler as profiler

        form.refill(12345)
        with profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _: None) as prof:
            form.update()
        count = 0
        stack = list(prof.profiler_result.get_data().values())
        while stack:
            node = stack.pop()
            if node.type == profiler.TracerEventType.Operator:
                count += 1
                continue  # an operator's own inner operators are not launches of the update
            stack.extend(node.children_node)
        return count
    except Exception as e:  # noqa: BLE001 - the count is an aid, the times come first
        print(f"  (the profiler's count failed: {e})")
        return None


def peak_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20


def median_times(rounds: list[dict[str, float]]) -> dict[str, float]:
    out = {phase: statistics.median(r[phase] for r in rounds) for phase in PHASES}
    out["total"] = statistics.median(sum(r.values()) for r in rounds)
    return out


def show(name: str, times: dict[str, float], base: dict[str, float] | None = None) -> None:
    cells = "  ".join(f"{phase} {times[phase] * 1000:8.1f} ms" + (f" (x{times[phase] / base[phase]:.2f})" if base
                                                                  else "") for phase in (*PHASES, "total"))
    print(f"  {name:11s} {cells}")


def one_form(args) -> None:
    """--form: one form alone in this process; prints a JSON line."""
    model = build(args.width, args.text_layers)
    before = peak_gib()
    form = Form(model, args.form, args.max_grad_norm, args.ema_profiles)
    rounds = []
    for i in range(args.rounds + 1):  # the first round makes the moments: not counted
        form.refill(i)
        times = form.update()
        if i:
            rounds.append(times)
    print(json.dumps({"form": args.form, "times": median_times(rounds), "peak_gib": peak_gib(),
                      "peak_before_update_gib": before, "operators": operator_calls(form)}))


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


def guarded(command: list[str], keep_gib: float) -> str:
    """`command`'s output; killed, and this script stopped, if the machine's available memory falls below
    `keep_gib` (a shared machine: the benchmark gives way rather than have the kernel choose what to kill)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while process.poll() is None:
        if available_gib() < keep_gib:
            process.kill()
            process.wait()
            sys.exit(f"stopped: the machine had less than {keep_gib} GiB available (run it on an idle machine)")
        time.sleep(0.2)
    if process.returncode:
        sys.exit(f"{command[2:4]} failed with exit code {process.returncode}")
    return process.stdout.read()


def main() -> None:
    from ldm.runtime.cli import ToolParser

    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64, help="the UNet's first channels (320: ldm-12layer)")
    parser.add_argument("--text_layers", type=int, default=2, help="LDMBert's layers (12: ldm-12layer)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max_grad_norm", type=float, default=1e-3, help="small: every update clips")
    parser.add_argument("--ema_profiles", type=int, default=0, choices=range(5),
                        help="post-hoc EMA profiles stepped beside the EMA (--ema_sigma_rels' count)")
    parser.add_argument("--memory", action="store_true", help="each form alone in its own process, with its peak "
                                                              "resident memory")
    parser.add_argument("--forms", nargs="+", default=["per_tensor", "flat", "fused"], type=form_name,
                        help="the forms, per_tensor first (the baseline), in this order with --memory: per_tensor, "
                             "flat, fused, fused@N (N threads)")
    parser.add_argument("--keep_available_gib", type=float, default=1.5, help="--memory: stop if the machine's "
                                                                                  "available memory falls below this")
    parser.add_argument("--form", type=form_name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.form:
        return one_form(args)
    if "per_tensor" not in args.forms:
        parser.error("--forms needs per_tensor, the baseline")
    if args.memory:
        results = {}
        for form in args.forms:
            out = guarded([sys.executable, __file__, "--form", form, "--width", str(args.width), "--text_layers",
                           str(args.text_layers), "--rounds", str(args.rounds), "--max_grad_norm",
                           str(args.max_grad_norm), "--ema_profiles", str(args.ema_profiles)],
                          args.keep_available_gib)
            results[form] = json.loads(out.strip().splitlines()[-1])
        print(f"width {args.width}, {args.text_layers} text layers, each form in its own process (in the order "
              f"{' '.join(args.forms)}), medians of {args.rounds} updates")
        base = results["per_tensor"]["times"]
        for form in args.forms:
            r = results[form]
            show(form, r["times"], None if form == "per_tensor" else base)
            print(f"  {'':11s} peak resident {r['peak_gib']:.2f} GiB (model and gradients: "
                  f"{r['peak_before_update_gib']:.2f}), {r['operators']} operator calls per update")
        for form in args.forms[1:]:
            print(f"{form} / per tensor, clip + optimizer + EMA: {results[form]['times']['total'] / base['total']:.3f}")
        return None

    import paddle

    forms = {name: Form(build(args.width, args.text_layers), name, args.max_grad_norm, args.ema_profiles)
             for name in args.forms}
    first = next(iter(forms.values()))
    print(f"width {args.width}, {args.text_layers} text layers: {len(first.trained)} weight tensors, "
          f"{sum(p.size for p in first.trained) / 1e6:.1f} M trained weights, "
          f"{args.rounds} interleaved rounds (Paddle {paddle.__version__})")
    rounds: dict[str, list] = {name: [] for name in forms}
    for i in range(args.rounds + 1):
        for name, form in forms.items():
            form.refill(i)
            times = form.update()
            if i:
                rounds[name].append(times)
    medians = {name: median_times(r) for name, r in rounds.items()}
    for name in forms:
        show(name, medians[name], None if name == "per_tensor" else medians["per_tensor"])
    calls = {name: operator_calls(form) for name, form in forms.items()}
    print(f"  operator calls per update: {', '.join(f'{name} {calls[name]}' for name in forms)}; clipped: "
          f"{all(form.clipped for form in forms.values())}")
    for name in forms:
        if name != "per_tensor":
            print(f"{name} / per tensor, clip + optimizer + EMA: "
                  f"{medians[name]['total'] / medians['per_tensor']['total']:.3f}")
    return None


def form_name(text: str) -> str:
    if text in ("per_tensor", "flat", "fused") or (text.startswith("fused@") and text[6:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"not a form: {text!r} (per_tensor, flat, fused, fused@N)")


if __name__ == "__main__":
    main()
