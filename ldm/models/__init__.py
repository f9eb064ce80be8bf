"""The model side: presets and building (`build`), the model families, one object each in one registry (`families`:
LDM and SD's UNet, PixArt's DiT, SD3's MMDiT), what a backbone is conditioned on, as one record (`conditioning`), text
encoders (`text`, `text_set`), what every backbone config says (`backbone`), PyTorch-matching initialisation
(`init`), the diffusion objective (`diffusion`) and its noise processes: DDPM, rectified flow, learned sigma's bound
(`noise`), the autoencoder's loss and scale (`autoencoder`), attention kernels (`attention`), EMA
(`ema`), aspect-ratio buckets at the model's size step (`buckets`), FLOPs per sample (`flops`), weights published
as pickles read without running their code (`pickled`), and parts in PyTorch's layout (diffusers' and transformers'
files), read and written (`torch_layout`).

May use `ldm.runtime` only.
"""
