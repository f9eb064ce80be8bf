"""Export a training checkpoint to an `LDMTextToImagePipeline` folder, or convert a CompVis checkpoint to one.

    python -m ldm.export --checkpoint OUTPUT/checkpoint-5000 --output OUTPUT/pipeline [--no_ema]
    python -m ldm.export --checkpoint OUTPUT/checkpoint-5000 --output OUTPUT/diffusers --format diffusers
    python -m ldm.export --from_compvis model.ckpt --config txt2img-1p4B-eval.yaml --tokenizer VOCAB_FOLDER \\
        --output OUTPUT/pipeline [--format diffusers]

EMA weights are used when the checkpoint has them (unless --no_ema). `--format ppdiffusers` (the default) loads
offline with ppdiffusers' `LDMTextToImagePipeline.from_pretrained(folder)`; `--format diffusers` with diffusers'
(PyTorch safetensors, a model card in README.md). --checkpoint may also name a pipeline folder of either layout
(converting it to the other). --from_compvis reads the original latent-diffusion `txt2img` checkpoint layout
(docs/interop.md).
"""

from __future__ import annotations

import argparse
import sys

from ldm.runtime.cli import ToolParser
from ldm.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m ldm.export", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint-<step> folder or a pipeline folder")
    source.add_argument("--from_compvis", metavar="CKPT", help="an original latent-diffusion txt2img .ckpt")
    parser.add_argument("--config", help="with --from_compvis: its YAML config (txt2img-1p4B-eval.yaml)")
    parser.add_argument("--tokenizer", help="with --from_compvis: a BERT WordPiece vocabulary folder (vocab.txt; "
                                            "the original used bert-base-uncased's)")
    parser.add_argument("--output", required=True, help="the pipeline folder to write")
    parser.add_argument("--format", choices=("ppdiffusers", "diffusers"), default="ppdiffusers",
                        help="the layout of the weights written (default: %(default)s)")
    parser.add_argument("--no_ema", action="store_true", help="export the raw weights even if EMA weights exist")
    args = parser.parse_args(argv)
    if args.from_compvis and not (args.config and args.tokenizer):
        parser.exit(2, "error: --from_compvis needs --config (its YAML) and --tokenizer (a vocab.txt folder)\n")
    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    from ldm.runtime.tracking import quiet_libraries

    quiet_libraries()
    from ldm.inference.compvis import convert_compvis
    from ldm.inference.export import export_checkpoint

    to_diffusers = args.format == "diffusers"
    try:
        if args.from_compvis:
            output, used_ema = convert_compvis(args.from_compvis, args.config, args.tokenizer, args.output,
                                               not args.no_ema, to_diffusers)
        else:
            output, used_ema = export_checkpoint(args.checkpoint, args.output, not args.no_ema, to_diffusers)
    except (UserError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint or args.from_compvis} ({'EMA' if used_ema else 'raw'} weights) to {output} "
          f"({args.format} layout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
