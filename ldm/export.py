"""Export a training checkpoint to a ppdiffusers `LDMTextToImagePipeline` folder.

    python -m ldm.export --checkpoint OUTPUT/checkpoint-5000 --output OUTPUT/pipeline [--no_ema]

EMA weights are used when the checkpoint has them (unless --no_ema). The result loads offline
with `LDMTextToImagePipeline.from_pretrained(folder)`.
"""

from __future__ import annotations

import argparse
import sys

from ldm.args import ToolParser


def export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config: dict, output: str) -> str:
    from ppdiffusers import LDMTextToImagePipeline

    from ldm.run_folder import atomic_folder
    from ldm.sampling import ddim_scheduler
    from ldm.serialization import writes_failing_as_os_errors

    pipeline = LDMTextToImagePipeline(vqvae=vae, bert=text_encoder, tokenizer=tokenizer, unet=unet,
                                      scheduler=ddim_scheduler(scheduler_config))
    with atomic_folder(output) as folder, writes_failing_as_os_errors(folder):
        pipeline.save_pretrained(folder)
    return output


def export_checkpoint(checkpoint: str, output: str, use_ema: bool = True) -> tuple[str, bool]:
    from ldm.inference import load_for_inference

    unet, text_encoder, vae, tokenizer, scheduler_config, used_ema = load_for_inference(checkpoint, use_ema)
    return export_pipeline(unet, text_encoder, vae, tokenizer, scheduler_config, output), used_ema


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m ldm.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-<step> folder")
    parser.add_argument("--output", required=True, help="the pipeline folder to write")
    parser.add_argument("--no_ema", action="store_true", help="export the raw weights even if EMA weights exist")
    args = parser.parse_args(argv)
    from ldm.runtime import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    from ldm.run_folder import CheckpointError
    from ldm.tracking import quiet_libraries

    quiet_libraries()
    try:
        output, used_ema = export_checkpoint(args.checkpoint, args.output, not args.no_ema)
    except (FileNotFoundError, OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} ({'EMA' if used_ema else 'raw'} weights) to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
