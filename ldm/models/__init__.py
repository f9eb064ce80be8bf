"""The model side: presets and building (`build`), PyTorch-matching initialisation (`init`), the diffusion
objective (`diffusion`), the autoencoder's loss and scale (`autoencoder`), attention kernels (`attention`), EMA
(`ema`), aspect-ratio buckets at the model's size step (`buckets`) and FLOPs per sample (`flops`).

May use `ldm.runtime` only.
"""
