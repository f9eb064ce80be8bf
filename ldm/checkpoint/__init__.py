"""A run's state on disk: the run folder and its lock (`run_folder`, `lock`), state trees as JSON and safetensors
(`serialization`) and what a checkpoint holds and how its model parts are read and written (`format`).
`python -m ldm.checkpoint upgrade` converts checkpoints of earlier versions. When to save and what to resume is the
training side's (`ldm.train.checkpointer`).

May use `ldm.runtime` and `ldm.models`.
"""
