"""Pretraining text-to-image latent diffusion models on LAION-style shards with PaddlePaddle.

Submodules are imported on demand: `import ldm` stays cheap (no Paddle import) and changes nothing in the
process; the entry points set the process up explicitly (`ldm.runtime.device.use_fast_cpu_kernels`).

The packages stand in one order, each using only those before it: `runtime`, `models`, `checkpoint`, `data`,
`config`, `inference`, `evaluation`, `train`. The modules at the top are the commands (`python -m ldm.generate`,
`export`, `evaluate`, `plot`, `launch`) and may use any of them. Each package's `__init__` says what it owns.

Imports go at the top of a module. A function imports inside itself only for one of these reasons:
- the module serves a command before its arguments are checked (`ldm.config.args`, `ldm.models.build`,
  `ldm.runtime.tracking`, the data tools, the entry points): Paddle, PaddleNLP and ppdiffusers take seconds
  to import (docs/benchmarks.md), and a wrong flag should answer at once;
- the package is optional (wandb, tensorboardX, fsspec's backends);
- the import reaches a private API that `ldm.runtime.compat` checks when it is used, or would be circular.
"""

__version__ = "0.1.0"
