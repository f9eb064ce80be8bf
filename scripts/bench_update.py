"""Benchmark the optimizer and EMA of an update against the multi-tensor and flat forms Paddle offers.

    .venv/bin/python scripts/bench_update.py [--preset ldm-12layer] [--rounds 5]

Builds the preset's UNet and LDMBert, takes one real backward pass, then times, interleaved, round after round:
- the optimizer: Paddle's AdamW as the runs make it (one `adamw_` kernel per weight tensor) against Paddle's Adam
  with `use_multi_tensor=True` (its `merged_adam_` kernel over all tensors at once) and no weight decay: Paddle
  3.3's AdamW has no multi-tensor path, so this is the most a merged AdamW could save (Adam's decay is L2, not
  AdamW's decoupled one, so it cannot stand in for it);
- the EMA: `ldm.models.ema.EMA.update` (scale, cast, multiply, add: four kernels a tensor) against the same average
  as one `lerp_` a tensor, and against one flat fp32 buffer of every average, updated by one `lerp_` from the
  weights gathered into one flat tensor (`paddle.concat`) at each update.
Prints the medians, the ratios to the baseline, and the largest difference of each EMA form from the baseline's.
"""

import argparse
import gc
import statistics
import time

import paddle
from bench_step import build_parts

from ldm.models.ema import EMA
from ldm.runtime.cli import ToolParser


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ldm-12layer")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    unet, text_encoder = build_parts(args.preset)
    ids = paddle.randint(1, 64, [1, 16])
    latents = paddle.randn([1, unet.config.in_channels, 8, 8])
    (unet(latents, paddle.to_tensor([500]), encoder_hidden_states=text_encoder(ids)[0]).sample ** 2).mean().backward()
    parameters = [p for layer in (unet, text_encoder) for p in layer.parameters() if p.grad is not None]
    weights = sum(p.size for p in parameters)
    print(f"{len(parameters)} weight tensors, {weights / 1e6:.1f}M weights ({args.preset}), median of {args.rounds} "
          "interleaved rounds")

    optimizers = {
        "AdamW (per tensor; the runs')": paddle.optimizer.AdamW(1e-9, parameters=parameters, weight_decay=0.02),
        "Adam use_multi_tensor, no decay": paddle.optimizer.Adam(1e-9, parameters=parameters,
                                                                 use_multi_tensor=True),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.rounds + 1):  # the first round makes the moments: not counted
        for name, optimizer in optimizers.items():
            times[name].append(timed(optimizer.step))
    report("optimizer step", {name: t[1:] for name, t in times.items()})
    del optimizers, optimizer  # their moments: the memory the EMA forms below need
    gc.collect()
    for p in parameters:
        p.clear_gradient(set_to_zero=False)

    class Holder(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.parts = paddle.nn.LayerList([unet, text_encoder])

    baseline = EMA(Holder())
    lerped = EMA(Holder())
    names = list(baseline.shadow)
    flat = paddle.concat([baseline.shadow[n].flatten() for n in names])
    tensors = [baseline.parameters[n] for n in names]

    @paddle.no_grad()
    def lerp_update() -> None:
        lerped.num_updates += 1
        weight = 1.0 - lerped.decay()
        for name, shadow in lerped.shadow.items():
            shadow.lerp_(lerped.parameters[name].detach(), weight)

    @paddle.no_grad()
    def flat_update(state={"n": 0}) -> None:  # noqa: B006 - the benchmark's own counter
        state["n"] += 1
        weight = 1.0 - min(0.9999, (1 + state["n"]) / (10 + state["n"]))
        flat.lerp_(paddle.concat([t.detach().flatten() for t in tensors]), weight)

    forms = {"EMA.update (4 kernels a tensor)": baseline.update, "lerp_ a tensor": lerp_update,
             "one flat buffer": flat_update}
    times = {name: [] for name in forms}
    for _ in range(args.rounds):
        for p in parameters:  # the weights move between updates, as in training
            p.set_value(p + 1e-3)
        for name, update in forms.items():
            times[name].append(timed(update))
    report("EMA update", times)
    by_tensor = flat_diff = 0.0
    offset = 0
    for n in names:  # tensor by tensor: a second copy of every average would not fit beside the three
        exact = baseline.shadow[n].flatten()
        by_tensor = max(by_tensor, float((lerped.shadow[n].flatten() - exact).abs().max()))
        flat_diff = max(flat_diff, float((flat[offset:offset + exact.shape[0]] - exact).abs().max()))
        offset += exact.shape[0]
    print(f"  largest difference from EMA.update after {args.rounds} updates: lerp_ {by_tensor:.2e}, "
          f"flat {flat_diff:.2e}")


def report(what: str, times: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = next(iter(medians.values()))
    print(what)
    for name, median in medians.items():
        print(f"  {name:34s} {median * 1000:9.1f} ms   x{median / base:.2f}")


if __name__ == "__main__":
    main()
