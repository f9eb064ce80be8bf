"""The model families (`ldm.models.families`): each preset is of the family its backbone and text encoder say, every
family's pipeline class is one a folder may be of, and conditioning is one record whatever fields a family reads."""

import numpy as np
import paddle
import pytest

from ldm.models.build import PIPELINE_CLASSES, PRESETS, model_family
from ldm.models.conditioning import Conditioning
from ldm.models.families import FAMILIES, config_family

FAMILY_OF_PRESET = {"ldm": "ldm", "sd": "sd", "pixart": "pixart", "dit": "pixart", "sd3": "sd3", "sdxl": "sdxl"}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_is_of_the_family_its_backbone_and_text_encoder_say(preset):
    assert model_family(preset).name == FAMILY_OF_PRESET[preset.split("-")[0]]


def test_the_registry_holds_one_family_per_name_and_each_pipeline_class_is_read():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert set(PIPELINE_CLASSES) == {f.pipeline_class for f in FAMILIES}
    assert all(f.backbone_folder in PIPELINE_CLASSES[f.pipeline_class] for f in FAMILIES)


def test_a_backbone_config_without_its_class_name_is_told_by_its_shape():
    assert config_family({"cross_attention_dim": 8}).name == "ldm"
    assert config_family({"cross_attention_dim": 8, "addition_embed_type": "text_time"}).name == "sdxl"
    assert config_family({"norm_type": "ada_norm_single"}).name == "pixart"
    assert config_family({"joint_attention_dim": 8, "pos_embed_max_size": 4}).name == "sd3"
    assert config_family({}, folder="transformer").name == "pixart"  # an unreadable config: its loader says so


def test_dropped_captions_take_the_empty_captions_text_and_keep_their_added_conditions():
    rows = Conditioning(paddle.ones([3, 2, 4]), paddle.ones([3, 2], "int64"), paddle.ones([3, 5]),
                        {"time_ids": paddle.arange(18, dtype="float32").reshape([3, 6])})
    empty = Conditioning(paddle.zeros([1, 2, 4]), paddle.to_tensor([[1, 0]]), paddle.zeros([1, 5]))
    dropped = rows.text_where(paddle.to_tensor([False, True, False]), empty)
    assert dropped.states[:, 0, 0].numpy().tolist() == [1, 0, 1]
    assert dropped.mask.numpy().tolist() == [[1, 1], [1, 0], [1, 1]]
    assert dropped.pooled[:, 0].numpy().tolist() == [1, 0, 1]
    np.testing.assert_array_equal(dropped.added["time_ids"].numpy(), rows.added["time_ids"].numpy())


def test_guidance_puts_the_unconditional_rows_first_field_by_field():
    cond = Conditioning(paddle.ones([2, 3, 4]), pooled=paddle.ones([2, 5]), added={"size": paddle.ones([2, 2])})
    uncond = Conditioning(paddle.zeros([1, 3, 4]), pooled=paddle.zeros([1, 5]), added={"size": paddle.ones([1, 2])})
    both = Conditioning.concat([uncond.repeat(2), cond])
    assert both.states.shape == [4, 3, 4] and both.mask is None
    assert both.pooled[:, 0].numpy().tolist() == [0, 0, 1, 1] and both.added["size"].shape == [4, 2]
