"""Using a trained model: loading a checkpoint or a pipeline for inference (`load`), DDIM sampling with
classifier-free guidance (`sampling`), and the export to a ppdiffusers pipeline (`export`).

May use `ldm.runtime`, `ldm.models` and `ldm.checkpoint`.
"""
