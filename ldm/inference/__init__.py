"""Using a trained model: loading a checkpoint or a pipeline for inference (`load`), DDIM sampling with
classifier-free guidance (`sampling`), the export to a ppdiffusers pipeline (`export`), and post-hoc EMA's
reconstruction from a run's snapshots (`posthoc`).

May use `ldm.runtime`, `ldm.models` and `ldm.checkpoint`.
"""
