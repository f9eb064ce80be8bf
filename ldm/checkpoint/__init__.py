"""A run's state on disk, saved and resumed: the checkpoint manager (`manager`: named parts, the per-rank layout,
background writes, sealing, rotation, loading), the checkpoint a run resumes read once (`resume`), the run folder
and its lock (`run_folder`, `lock`), background file writing (`background`), state trees as JSON and safetensors
(`serialization`) and what a checkpoint holds and how its model parts are read and written (`format`).
`python -m ldm.checkpoint upgrade` converts checkpoints of earlier versions. When a save is due and what the run
state is made of is the training run's (`ldm.train.run`).

May use `ldm.runtime` and `ldm.models`.
"""
