"""Preparing a corpus, above the data library: the tools of `python -m ldm.prepare` (`tools`: stats, plan, bench,
convert, encode, synth), writing shards (`write`), encoding latents with the frozen autoencoder (`encode`), the
demo's synthetic corpus (`synth`) and the naive loader the benchmarks compare with (`naive`).

May use `ldm.runtime`, `ldm.models` (the autoencoder and buckets for `encode`), `ldm.checkpoint` (a checkpoint's
data position for `plan`) and `ldm.data`.
"""
