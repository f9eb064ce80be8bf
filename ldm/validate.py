"""The held-out validation loss of an exported pipeline or a training checkpoint, as training logs it.

    python -m ldm.validate --model OUT/pipeline --file_list held_out.list [--validation_samples 256] [--json]
    python -m ldm.validate --model OUT/checkpoint-5000 --file_list held_out.list --weights raw
    python -m paddle.distributed.launch --nproc_per_node 2 ldm/validate.py ...   (the same numbers, split)

Prints the mean loss and the loss at each fixed timestep (`ldm.evaluation.heldout`): with the same records,
timesteps and weights, the numbers training logged as eval/loss and eval/loss_t<t> (eval/ema_* for the
EMA weights), so two models can be compared on one held-out set.
"""

from __future__ import annotations

import json
import sys


def build_parser():
    from ldm.args import ToolParser

    parser = ToolParser(prog="python -m ldm.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an exported pipeline folder or a training checkpoint")
    parser.add_argument("--file_list", required=True, help="held-out shards: a list of filelists, as for training")
    parser.add_argument("--validation_samples", type=int, default=256, help="records evaluated (the first ones)")
    parser.add_argument("--validation_timesteps", type=int, default=8, help="timesteps per record")
    parser.add_argument("--validation_batch_size", type=int, default=8, help="records per forward pass")
    parser.add_argument("--weights", choices=("ema", "raw"), default="ema",
                        help="a checkpoint's EMA weights when it has them (as exported), or its trained ones")
    parser.add_argument("--resolution", type=int, default=None,
                        help="image size (default: the model's, from its UNet and autoencoder)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ppdiffusers import DDPMScheduler

    from ldm.data.filelist import check_shards, read_file_list
    from ldm.data.latents import fingerprint
    from ldm.distributed import Distributed
    from ldm.evaluation.heldout import HeldOut, fixed_timesteps, read_records
    from ldm.inference import is_pipeline, load_for_inference
    from ldm.models.autoencoder import autoencoder_identity
    from ldm.models.build import model_resolution
    from ldm.models.diffusion import LatentDiffusion
    from ldm.train.errors import user_errors

    dist = Distributed.init()
    with user_errors():
        check_shards(read_file_list(args.file_list), args.file_list)  # before the model takes its time to load
        try:
            unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(
                args.model, use_ema=args.weights == "ema")
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        model = LatentDiffusion(unet, text_encoder, vae, DDPMScheduler.from_config(scheduler_config))
        resolution = args.resolution or model_resolution(unet, vae)
        records = read_records(args.file_list, args.validation_samples, resolution=resolution, tokenizer=tokenizer,
                               model_max_length=tokenizer.model_max_length,
                               autoencoder=fingerprint(autoencoder_identity(vae)), autoencoder_source=args.model)
        timesteps = fixed_timesteps(args.validation_timesteps, model.noise_scheduler.config.num_train_timesteps)
        metrics = HeldOut(records, timesteps, dist, args.validation_batch_size).evaluate(model)
    if dist.is_main:
        weights = "EMA" if used_ema else "the pipeline's" if is_pipeline(args.model) else "trained"
        if args.json:
            print(json.dumps({"model": args.model, "weights": weights, "records": len(records),
                              "resolution": resolution, **metrics}))
        else:
            print(f"{args.model} ({weights} weights), {len(records)} records at {resolution} px")
            for name, value in metrics.items():
                print(f"{name:>12} {value:.6f}")
    return 0


if __name__ == "__main__":
    from ldm.distributed import run_main

    run_main(main)
