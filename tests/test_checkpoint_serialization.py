"""State trees as JSON + safetensors, whole or in shards: what every rank writes is read back whole, or only the
arrays a rank asks for, from either layout."""

import json

import numpy as np
import pytest

from ldm.checkpoint.serialization import (
    StateFormatError,
    has_state,
    load_state,
    save_state,
    shard_name,
    write_state_index,
)


def tree(names, offset=0.0):
    return {**{f"{n}_moment1_0": np.full((2, 3), i + offset, np.float32) for i, n in enumerate(names)},
            "LR_Scheduler": {"last_epoch": 7}, "master_weights": {n: np.arange(3.0) + offset for n in names}}


def test_shards_read_back_whole_or_in_part_and_the_whole_file_reads_the_same_way(tmp_path):
    shards = [tree(["linear_0.w_0", "linear_0.b_0"]), tree(["linear_1.w_0"], offset=10)]
    keys = [save_state(str(tmp_path), shard_name("optimizer", rank, 2), t) for rank, t in enumerate(shards)]
    write_state_index(str(tmp_path), "optimizer", keys)
    assert has_state(str(tmp_path), "optimizer")
    index = json.loads((tmp_path / "optimizer.index.json").read_text())
    assert index["weight_map"]["linear_1.w_0_moment1_0"] == "optimizer-00002-of-00002.safetensors"

    whole = load_state(str(tmp_path), "optimizer")
    assert set(whole) == {"linear_0.w_0_moment1_0", "linear_0.b_0_moment1_0", "linear_1.w_0_moment1_0",
                          "LR_Scheduler", "master_weights"}
    assert set(whole["master_weights"]) == {"linear_0.w_0", "linear_0.b_0", "linear_1.w_0"}
    np.testing.assert_array_equal(whole["linear_1.w_0_moment1_0"], np.full((2, 3), 10, np.float32))

    part = load_state(str(tmp_path), "optimizer", lambda key: "linear_1" in key)
    assert set(part) == {"linear_1.w_0_moment1_0", "LR_Scheduler", "master_weights"}
    assert set(part["master_weights"]) == {"linear_1.w_0"} and part["LR_Scheduler"] == {"last_epoch": 7}

    single = tmp_path / "single"
    single.mkdir()
    save_state(str(single), "optimizer", tree(["linear_0.w_0", "linear_1.w_0"]))
    assert set(load_state(str(single), "optimizer", lambda key: "linear_0" in key)) == {
        "linear_0.w_0_moment1_0", "LR_Scheduler", "master_weights"}


def test_a_shard_the_index_names_but_that_is_gone_is_an_error(tmp_path):
    keys = [save_state(str(tmp_path), shard_name("ema", 0, 2), {"shadow.a": np.ones(2)}),
            save_state(str(tmp_path), shard_name("ema", 1, 2), {"shadow.b": np.ones(2)})]
    write_state_index(str(tmp_path), "ema", keys)
    (tmp_path / "ema-00002-of-00002.json").write_text(json.dumps({"shadow.b": {"__array__": "shadow.c"}}))
    with pytest.raises(StateFormatError, match="'shadow.c' is in no file"):
        load_state(str(tmp_path), "ema")
