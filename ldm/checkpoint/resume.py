"""The checkpoint a run continues from, read once.

A resume needs the checkpoint's training state (the step, the world size it was saved on, every rank's data
position and random state, the small parts), the record of the run that wrote it (its seed, its settings, its
lineage) and its model record (the autoencoder it was trained with). `Resume` reads each file once, before
anything is written. What it says about the configuration is read from it before the model is built (the seed,
the autoencoder and frozen text encoder, the record the checks compare); the run's state is restored from it in one
call (`ldm.checkpoint.manager.CheckpointManager.restore`), which reads the optimizer's and the EMA's own files
when their parts load.
"""

from __future__ import annotations

import json
import os

from ldm.checkpoint.format import (
    read_model_record,
    read_training_state,
    recorded_autoencoder_folder,
    recorded_text_encoder_folder,
)
from ldm.checkpoint.run_folder import DAMAGED_WAYS_OUT, RUN_CONFIG, CheckpointError


class Resume:
    def __init__(self, path: str):
        self.path = path
        self.training_state = read_training_state(path)
        self.record = _json_or_none(os.path.join(path, RUN_CONFIG))  # None: written before run records existed
        try:
            self.model = read_model_record(path)
        except FileNotFoundError:  # not a text-to-image checkpoint (the autoencoder's), or from before the record
            self.model = None
        except ValueError as e:
            raise damaged(path, "ldm_model.json", e) from None

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    @property
    def step(self) -> int:
        return self.training_state["step"]

    @property
    def streams(self) -> list[dict]:
        """Every saved rank's data position."""
        return self.training_state["stream"]

    @property
    def lineage(self) -> dict | None:
        """Where the run of this checkpoint began (`--init_from_checkpoint`), as its record says."""
        return self.record.get("lineage") if isinstance(self.record, dict) else None

    @property
    def autoencoder(self) -> dict | None:
        """The identity of the autoencoder it was trained with (`ldm.models.autoencoder.autoencoder_identity`)."""
        return (self.model or {}).get("vae_identity")

    @property
    def autoencoder_folder(self) -> str | None:
        """The folder of that autoencoder (its run's `vqvae/`), if it is there."""
        return recorded_autoencoder_folder(self.path, self.model) if self.model is not None else None

    @property
    def text_encoder(self) -> dict | None:
        """The identity of the frozen text encoder it was trained with (`ldm.models.text.text_encoder_identity`);
        None when its text encoder trained (it is in the checkpoint)."""
        return (self.model or {}).get("text_encoder_identity")

    @property
    def text_encoder_folder(self) -> str | None:
        """The folder of that frozen text encoder (its run's `text_encoder/`), if it is there."""
        return recorded_text_encoder_folder(self.path, self.model) if self.model is not None else None


def _json_or_none(path: str):
    """The file's JSON; None when there is no such file; a damaged one is refused in one line."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise damaged(os.path.dirname(path), os.path.basename(path), e) from None


def damaged(checkpoint: str, name: str, error: ValueError) -> CheckpointError:
    # a sealed checkpoint's manifest catches a damaged file first: this is a checkpoint from before manifests
    return CheckpointError(f"--resume_from_checkpoint {checkpoint}: its {name} is not valid JSON ({error}). "
                           f"{DAMAGED_WAYS_OUT}")
