"""The caption-image data path: file lists -> shards -> records -> training samples.

Pure-Python parts (`filelist`, `shard`, `record`, `plan`, `resume`, `stream`) import neither Paddle nor
PaddleNLP, so the data tools start fast; `dataset` adds the Paddle `IterableDataset` and
`tokenize` the PaddleNLP tokenizer.
"""
