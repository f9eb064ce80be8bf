"""How a run is configured and recorded: the argument groups both entry points parse (`args`), `--config` files,
and the run's record in `run.json` and each checkpoint, with the check of a resume against it (`record`).

May use `ldm.runtime`, `ldm.models`, `ldm.checkpoint` and `ldm.data` (to validate their flags).
"""
