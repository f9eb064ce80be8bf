"""Pretraining text-to-image latent diffusion models on LAION-style shards with PaddlePaddle.

Submodules are imported on demand: `import ldm` stays cheap (no Paddle import).
"""

__version__ = "0.1.0"
