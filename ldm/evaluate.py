"""`python -m ldm.evaluate`: FID statistics, FID and CLIP score, offline (the commands: `ldm.evaluation.cli`)."""

from __future__ import annotations

from ldm.evaluation.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    from ldm.distributed import run_main

    run_main(main)
