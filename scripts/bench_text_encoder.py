"""What a frozen text encoder and cached text states save: training-step time and per-rank state, against the LDMBert
encoder trained jointly (the recipe), measured on this machine in one run.

    .venv/bin/python scripts/bench_text_encoder.py [--unet ldm-12layer] [--resolution 128] [--batch 2] [--steps 3]
    .venv/bin/python scripts/bench_text_encoder.py --memory_only | --time_only

Step time: one preset's UNet trained on precomputed latents (the autoencoder left out: each mode pays it alike, or
not at all with precomputed latents), through the training loss (`LatentDiffusion`) with three text paths of the same
width (the preset's LDMBert's):

  joint     LDMBert forward and backward, its weights in the optimizer (the recipe)
  frozen    a CLIP text model (the Stable Diffusion family's; ViT-L/14's shape at width 768) kept frozen
            (`--train_text_encoder false`): its forward only, out of the optimizer
  cached    the same model on cached text states (`encode --text_embeddings`): no encoder forward at all

Each step is the loss's forward, backward and an AdamW step; the median of `--steps` after one warm-up, each mode in
turn in the same process. Per-rank state (`ldm.train.memory`: weights, gradients, AdamW moments, EMA, frozen parts;
before activations) is counted for ldm-32layer's UNet with a 12-layer encoder and for Stable Diffusion 1.5's shapes
(UNet 860 M, CLIP ViT-L/14 text 123 M), jointly trained and frozen, on one card without sharding.
"""

from __future__ import annotations

import argparse
import gc

from bench_encoder_share import seconds

GIB = 2**30

# Stable Diffusion 1.5's UNet (diffusers' `unet/config.json` of runwayml/stable-diffusion-v1-5) and CLIP ViT-L/14's
# text tower (`text_encoder/config.json`): architectures only, no weights.
SD15_UNET = {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
             "block_out_channels": [320, 640, 1280, 1280], "attention_head_dim": 8, "cross_attention_dim": 768,
             "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
             "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3}
CLIP_L_TEXT = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu"}


def clip_text(width: int, layers: int, heads: int, ffn: int):
    from paddlenlp.transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**{**CLIP_L_TEXT, "hidden_size": width, "num_hidden_layers": layers,
                                           "num_attention_heads": heads, "intermediate_size": ffn}))


def step_times(preset: str, resolution: int, batch: int, steps: int) -> dict[str, float]:
    import numpy as np
    import paddle

    from ldm.models.build import build_components
    from ldm.models.diffusion import LatentDiffusion

    parts = build_components(preset, vocab_size=30522, model_max_length=77, seed=0)
    width, layers = parts.text_encoder.config.d_model, parts.text_encoder.config.encoder_layers
    clip = clip_text(width, layers, heads=width // 64, ffn=4 * width)
    joint = LatentDiffusion(parts.unet, parts.text_encoder, parts.vae, parts.noise_scheduler)
    frozen = LatentDiffusion(parts.unet, clip, parts.vae, parts.noise_scheduler, freeze_text_encoder=True)
    latent = resolution // 8
    moments = paddle.randn([batch, 2 * parts.unet.config.in_channels, latent, latent])
    ids = paddle.randint(1, 30000, [batch, 77])
    frozen.keep_empty_caption(np.ones([77], np.int64))
    with paddle.no_grad():
        states = clip(ids)[0].numpy()
    dropped = np.zeros([batch], bool)

    def trainer(model, **inputs):
        optimizer = paddle.optimizer.AdamW(1e-5, parameters=[p for p in model.parameters() if not p.stop_gradient])

        def step():
            loss = model(None, inputs.get("input_ids"), moments, conditioning=inputs.get("conditioning"))
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            float(loss)
        return step

    modes = {"joint": (joint, {"input_ids": ids}), "frozen": (frozen, {"input_ids": ids}),
             "cached": (frozen, {"conditioning": {"states": states, "dropped": dropped}})}
    times = {}
    for name, (model, inputs) in modes.items():  # one optimizer's state at a time: a UNet's is gigabytes
        times[name] = seconds(trainer(model.train(), **inputs), steps)  # one warm-up, the median
        gc.collect()
    return times


def state(unet, encoder, trained: bool) -> dict[str, float]:
    """The per-rank state in GiB of a UNet with `encoder` trained jointly or frozen (one card, EMA of what trains)."""
    import paddle

    from ldm.train.memory import memory_by_rank

    class Pair(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.unet, self.text_encoder = unet, encoder

    for p in encoder.parameters():
        p.stop_gradient = not trained
    memory = memory_by_rank(Pair(), world_size=1, ema=True)["ranks"][0]
    return {**{k: v / GIB for k, v in memory.items()}, "total": sum(memory.values()) / GIB}


def memory_rows() -> list[tuple[str, dict, dict]]:
    from ppdiffusers import UNet2DConditionModel
    from ppdiffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel

    from ldm.models.build import read_config, resolve_source

    rows = []  # built at initialisation (a few GB each): the counts are what matters
    unet = UNet2DConditionModel.from_config(read_config(f"{resolve_source('ldm-32layer')}/unet"))
    bert = read_config(f"{resolve_source('ldm-32layer')}/bert")
    bert.pop("architectures", None)
    bert = LDMBertModel(LDMBertConfig(**{**bert, "encoder_layers": 12}))
    for p in bert.to_logits.parameters():
        p.stop_gradient = True
    rows.append(("ldm-32layer UNet + 12-layer LDMBert (1280 wide)", state(unet, bert, True),
                 state(unet, bert, False)))
    del unet, bert
    unet, clip = UNet2DConditionModel.from_config(SD15_UNET), clip_text(768, 12, 12, 3072)
    rows.append(("SD 1.5 shapes: UNet + CLIP ViT-L/14 text", state(unet, clip, True), state(unet, clip, False)))
    return rows


def print_memory() -> None:
    print("per-rank state before activations (GiB; one card, AdamW, EMA of what trains):")
    print(f"  {'model':<52} {'joint':>8} {'frozen':>8} {'frozen/joint':>13}")
    for name, joint, frozen in memory_rows():
        print(f"  {name:<52} {joint['total']:8.2f} {frozen['total']:8.2f} {frozen['total'] / joint['total']:13.2f}",
              flush=True)
    gc.collect()


def main() -> None:
    from ldm.runtime.cli import ToolParser

    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unet", default="ldm-12layer", help="the preset whose UNet and LDMBert width are timed")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory_only", action="store_true")
    parser.add_argument("--time_only", action="store_true")
    args = parser.parse_args()

    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    if not args.time_only:
        print_memory()
    if args.memory_only:
        return
    times = step_times(args.unet, args.resolution, args.batch, args.steps)
    print(f"training step on latents, {args.unet}'s UNet, {args.resolution} px, batch {args.batch} (median of "
          f"{args.steps}):")
    for name, took in times.items():
        print(f"  {name:<7} {took:7.3f} s   {took / times['joint']:.2f} of joint")
    joint, frozen, cached = times["joint"], times["frozen"], times["cached"]
    print(f"cached / frozen on the fly: {cached / frozen:.2f}; frozen / joint: {frozen / joint:.2f}; "
          f"cached / joint: {cached / joint:.2f}")


if __name__ == "__main__":
    main()
