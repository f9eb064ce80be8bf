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


def test_a_late_part_holds_its_restored_state_until_its_object_is_handed_over():
    """The one restore hands every part its state at once; a part whose object the driver makes later (the Trainer's
    optimizer, schedule and scaler) keeps it and loads it into the object it is handed."""
    from types import SimpleNamespace

    from ldm.checkpoint.manager import Late, Part

    def part_of(obj):
        return Part(state=lambda: {"value": obj.value}, load=lambda saved: setattr(obj, "value", saved["value"]))

    late, obj = Late(part_of), SimpleNamespace(value=0)
    late.load({"value": 7})  # the restore, before the object exists
    assert not late.handed and obj.value == 0
    late.hand(obj)
    assert obj.value == 7 and late.state() == {"value": 7}
    obj.value = 8  # a part handed over first loads at once
    after = Late(part_of)
    after.hand(obj)
    after.load({"value": 9})
    assert obj.value == 9


def test_the_runs_steps_come_in_their_order_once_each_and_close_from_any():
    from ldm.train.run import Step, next_step

    at = Step.PLAN
    for step in (Step.BUILD, Step.OPEN, Step.RESTORE, Step.CHECK, Step.WRITE, Step.SIGNALS, Step.END, Step.EXPORT):
        at = next_step(at, step)  # a run resumed at its end passes over HAND and BEGIN
    with pytest.raises(RuntimeError, match="BEGIN comes after EXPORT"):
        next_step(at, Step.BEGIN)
    with pytest.raises(RuntimeError, match="OPEN comes after OPEN"):
        next_step(Step.OPEN, Step.OPEN)
    assert next_step(Step.OPEN, Step.CLOSE) is Step.CLOSE
