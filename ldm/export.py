"""Export a training checkpoint to a ppdiffusers `LDMTextToImagePipeline` folder.

    python -m ldm.export --checkpoint OUTPUT/checkpoint-5000 --output OUTPUT/pipeline [--no_ema]

EMA weights are used when the checkpoint has them (unless --no_ema). The result loads offline
with `LDMTextToImagePipeline.from_pretrained(folder)`.
"""

from __future__ import annotations

import argparse
import sys

from ldm.runtime.cli import ToolParser


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m ldm.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-<step> folder")
    parser.add_argument("--output", required=True, help="the pipeline folder to write")
    parser.add_argument("--no_ema", action="store_true", help="export the raw weights even if EMA weights exist")
    args = parser.parse_args(argv)
    from ldm.runtime.device import use_fast_cpu_kernels

    use_fast_cpu_kernels()
    from ldm.checkpoint.run_folder import CheckpointError
    from ldm.runtime.tracking import quiet_libraries

    quiet_libraries()
    from ldm.inference.export import export_checkpoint

    try:
        output, used_ema = export_checkpoint(args.checkpoint, args.output, not args.no_ema)
    except (FileNotFoundError, OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} ({'EMA' if used_ema else 'raw'} weights) to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
