"""The caption-image data path: file lists -> shards -> records -> training samples, and the data tools
(`python -m ldm.data`), encoding latents with the frozen autoencoder among them.

Pure-Python parts (`filelist`, `shard`, `record`, `plan`, `resume`, `stream`) import neither Paddle nor
PaddleNLP, so the data tools start fast; `dataset` adds the Paddle `IterableDataset` and `tokenize` the
PaddleNLP tokenizer.

May use `ldm.runtime`, `ldm.models` (buckets; the autoencoder for `encode`) and `ldm.checkpoint` (a checkpoint's
data position for `plan`).
"""
