"""The caption-image data path: file lists -> shards -> records -> training samples.

Pure-Python parts (`filelist`, `shard`, `record`, `plan`, `resume`, `stream`) import neither Paddle nor
PaddleNLP, so the data tools start fast; `dataset` adds the Paddle `IterableDataset` and `tokenize` the
PaddleNLP tokenizer. The tools that prepare a corpus (`python -m ldm.prepare stats|plan|bench|convert|encode|synth`)
live above it, in `ldm.prepare`; this package's `__main__` only hands the command line to them.

May use `ldm.runtime` only.
"""
