"""The checkpoint a run resumes, read once (`ldm.checkpoint.resume.Resume`): what it hands the run, and what it
refuses."""

import json
import os

import pytest

from ldm.checkpoint.format import MODEL_JSON, TRAINING_STATE
from ldm.checkpoint.resume import Resume
from ldm.checkpoint.run_folder import RUN_CONFIG, CheckpointError
from ldm.checkpoint.serialization import save_state
from ldm.runtime.errors import UserError


def checkpoint(folder, *, record=True, model=True):
    os.makedirs(folder / "vqvae")
    (folder / "vqvae" / "config.json").write_text("{}")
    save_state(str(folder), TRAINING_STATE, {"step": 7, "world_size": 1, "stream": [{"batches": 14}]})
    if record:
        (folder / RUN_CONFIG).write_text(json.dumps({"lineage": {"init_from": "parent"}, "arguments": {}}))
    if model:
        (folder / MODEL_JSON).write_text(json.dumps({"vae": "vqvae", "vae_identity": {"weights_sha256": "ab"}}))
    return folder


def test_a_resume_hands_each_part_what_the_checkpoint_holds(tmp_path):
    resume = Resume(str(checkpoint(tmp_path / "checkpoint-7")))
    assert (resume.step, resume.streams, resume.lineage) == (7, [{"batches": 14}], {"init_from": "parent"})
    assert resume.autoencoder == {"weights_sha256": "ab"}
    assert resume.autoencoder_folder == str(tmp_path / "checkpoint-7" / "vqvae")
    assert os.fspath(resume) == str(resume) == str(tmp_path / "checkpoint-7")
    # records written before they existed, and the autoencoder's checkpoints, have neither file: nothing is refused
    bare = Resume(str(checkpoint(tmp_path / "checkpoint-8", record=False, model=False)))
    assert (bare.record, bare.model, bare.lineage, bare.autoencoder, bare.autoencoder_folder) == (None,) * 5


@pytest.mark.parametrize("name", [RUN_CONFIG, MODEL_JSON])
def test_a_damaged_record_is_one_line_naming_it(tmp_path, name):
    folder = checkpoint(tmp_path / "checkpoint-7")
    (folder / name).write_text('{"vae": ')
    with pytest.raises(CheckpointError, match=f"its {name} is not valid JSON") as refused:
        Resume(str(folder))
    assert isinstance(refused.value, UserError) and "\n" not in str(refused.value)
