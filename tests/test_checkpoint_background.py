"""The background save's parts: the safetensors writer that hashes as it writes, the snapshot buffers, the writer
thread and the receipts the seal reads (`ldm.checkpoint.background`, `ldm.checkpoint.serialization`)."""

import hashlib
import json
import os

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file, save_file

from ldm.checkpoint.background import BackgroundWriter, FileJob, HostBuffers, read_receipts, write_files
from ldm.checkpoint.run_folder import MANIFEST, RunFolder, checkpoint_problem, write_manifest
from ldm.checkpoint.serialization import split_state, write_safetensors
from ldm.runtime.distributed import Distributed


def mixed_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((33, 7)).astype("float32"), "b": rng.standard_normal(5).astype("float16"),
            "steps": np.arange(3, dtype="int64"), "bits": np.arange(4, dtype="uint16"),
            "d": rng.standard_normal(2), "i8": np.arange(3, dtype="int8"), "u8": np.arange(6, dtype="uint8"),
            "i32": np.arange(2, dtype="int32"), "scalar": np.array(2.5, dtype="float32"),
            "ünïcode name": np.ones(1, "float32")}


@pytest.mark.parametrize("metadata", [None, {"format": "pd"}])
def test_the_writer_writes_the_bytes_safetensors_writes_and_hashes_them(tmp_path, metadata):
    arrays = mixed_arrays()
    save_file(arrays, str(tmp_path / "reference.safetensors"), metadata=metadata)
    written = write_safetensors(str(tmp_path / "ours.safetensors"), arrays, metadata)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "reference.safetensors").read_bytes()
    assert written.size == len(ours) and written.sha256 == hashlib.sha256(ours).hexdigest()
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    for key, value in arrays.items():
        assert loaded[key].dtype == value.dtype and np.array_equal(loaded[key], value), key


def test_booleans_are_written_as_safetensors_reads_them(tmp_path):
    # (not compared with `save_file`: once Paddle's libraries are imported numpy names its bool "bool8", which
    # `save_file` refuses)
    mask = np.random.default_rng(1).random(9) > 0.5
    write_safetensors(str(tmp_path / "mask.safetensors"), {"mask": mask, "w": np.ones(2, "float32")})
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mask.safetensors"), framework="numpy") as f:
        assert np.array_equal(f.get_tensor("mask"), mask)


def test_a_failed_write_is_an_os_error_naming_the_file(tmp_path):
    (tmp_path / "gone").mkdir()
    os.rmdir(tmp_path / "gone")
    with pytest.raises(OSError) as caught:
        write_safetensors(str(tmp_path / "gone" / "x.safetensors"), mixed_arrays())
    assert "x.safetensors" in str(caught.value)


def test_the_snapshot_is_a_copy_into_buffers_reused_from_save_to_save():
    """Training goes on while the files are written: the snapshot must not change with the weights, and a second
    save copies into the same memory instead of allocating it again."""
    weight = paddle.to_tensor(np.arange(12, dtype="float32").reshape(3, 4))
    tree = {"net": {"weight": weight, "step": 3}, "lr": [paddle.to_tensor([0.5]), 1e-3]}
    buffers = HostBuffers()
    _, first = split_state(tree, buffers.taker("state"))
    snapshot = first["net/weight"].copy()
    weight.add_(paddle.ones_like(weight))  # an optimizer step, in place
    np.testing.assert_array_equal(first["net/weight"], snapshot)
    _, second = split_state(tree, buffers.taker("state"))
    assert second["net/weight"] is first["net/weight"]  # the same buffer, now holding the new values
    np.testing.assert_array_equal(second["net/weight"], snapshot + 1)
    assert buffers.nbytes == 12 * 4 + 4


def test_buffers_are_carved_from_the_pool_reserved_at_start_then_allocated(tmp_path):
    """The first snapshot copies into memory touched at the start of the run (the pool), aligned; what does not fit
    is allocated as before; the written file is the same either way."""
    state = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 5), np.float16), "c": np.zeros(400, np.float64)}
    buffers = HostBuffers()
    buffers.reserve(256)
    assert buffers.reserved == 256
    take = buffers.taker("state")
    taken = {key: take(key, value) for key, value in state.items()}
    pool = buffers._pool
    assert np.shares_memory(taken["a"], pool) and np.shares_memory(taken["b"], pool)  # 40 + 30 bytes, aligned
    assert taken["b"].ctypes.data % HostBuffers.ALIGN == 0
    assert not np.shares_memory(taken["c"], pool)  # 3,200 bytes: past the pool, allocated
    for key, value in state.items():
        np.testing.assert_array_equal(taken[key], value)
    assert take("a", state["a"] + 1) is taken["a"]  # reused at the next save
    write_safetensors(str(tmp_path / "pooled.safetensors"), taken)
    save_file(state, str(tmp_path / "reference.safetensors"))
    assert all(np.array_equal(load_file(str(tmp_path / "pooled.safetensors"))[k], v)
               for k, v in {**state, "a": state["a"] + 1}.items())
    assert HostBuffers(copy=False).reserved == 0  # nothing reserved where nothing is copied


def test_a_state_dealt_among_ranks_is_whole_again_when_read(tmp_path):
    """Each rank writes the arrays of its share and the whole structure: the union is the state."""
    from ldm.checkpoint.format import share_out
    from ldm.checkpoint.serialization import array_sizes, load_state, shard_name, write_state_index

    tree = {"m": {f"p{i}": np.full(i + 1, i, "float32") for i in range(5)}, "counter": 7, "nested": [1, "a"]}
    shares = share_out(array_sizes(tree), 2)
    keys = []
    for rank, share in enumerate(shares):
        name = shard_name("optimizer", rank, 2)
        structure, arrays = split_state(tree, mine=set(share).__contains__)
        write_files(str(tmp_path), [FileJob(f"{name}.json", data=structure), FileJob(f"{name}.safetensors", arrays)],
                    rank, 2)
        keys.append(sorted(arrays))
    assert sorted(keys[0] + keys[1]) == sorted(array_sizes(tree)) and keys[0] and keys[1]
    write_state_index(str(tmp_path), "optimizer", keys)
    read_receipts(str(tmp_path), 2)
    state = load_state(str(tmp_path), "optimizer")
    assert state["counter"] == 7 and state["nested"] == [1, "a"]
    for key, value in tree["m"].items():
        np.testing.assert_array_equal(state["m"][key], value)


def test_the_seal_takes_the_receipts_hashes_and_refuses_a_rank_that_did_not_finish(tmp_path):
    folder = tmp_path / "temp"
    folder.mkdir()
    big = {"w": np.random.default_rng(0).standard_normal(1000).astype("float32")}
    write_files(str(folder), [FileJob("unet/w-1.safetensors", big)], 0, 2)
    with pytest.raises(OSError, match="rank.s. 1 did not finish"):
        read_receipts(str(folder), 2)
    write_files(str(folder), [FileJob("unet/w-2.safetensors", big), FileJob("s.json", data=b"{}")], 1, 2)
    (folder / "small.json").write_text("{}")  # written by rank 0 at the snapshot: hashed at the seal
    known = read_receipts(str(folder), 2)
    assert sorted(known) == ["s.json", "unet/w-1.safetensors", "unet/w-2.safetensors"]
    assert not [n for n in os.listdir(folder) if n.startswith(".written-")]  # receipts are not checkpoint files
    manifest = write_manifest(str(folder), known)
    assert sorted(manifest["files"]) == ["s.json", "small.json", "unet/w-1.safetensors", "unet/w-2.safetensors"]
    # the receipts' hashes are those of the bytes on disk
    assert checkpoint_problem(str(folder)) is None
    data = json.loads((folder / MANIFEST).read_text())
    assert data["files"]["unet/w-1.safetensors"]["sha256"] == \
        hashlib.sha256((folder / "unet/w-1.safetensors").read_bytes()).hexdigest()


def test_a_file_changed_after_its_receipt_is_not_sealed(tmp_path):
    run = RunFolder(str(tmp_path / "run"), Distributed.init())
    temp = run.begin_save(3)
    known = write_files(temp, [FileJob("a.safetensors", {"x": np.ones(10, "float32")})], 0, 1)
    read_receipts(temp, 1)
    with open(os.path.join(temp, "a.safetensors"), "ab") as f:
        f.write(b"more")
    with pytest.raises(OSError, match="changed after it was written"):
        run.seal(3, temp, known)
    assert not os.path.exists(temp) and not os.path.exists(run.path("checkpoint-3"))


def test_the_writer_runs_one_task_at_a_time_and_hands_back_its_error():
    import threading

    release = threading.Event()
    writer = BackgroundWriter()
    task = writer.start("slow", release.wait)
    assert writer.busy
    with pytest.raises(RuntimeError, match="still running"):
        writer.start("second", lambda: None)
    release.set()
    assert writer.wait() is task and task.error is None and not writer.busy
    failing = writer.start("failing", lambda: 1 / 0)
    writer.wait()
    assert isinstance(failing.error, ZeroDivisionError) and not writer.busy


def test_a_save_that_waits_for_its_writing_brings_one_tensor_at_a_time_to_host_memory(tmp_path):
    """`--async_save false` writes from the tensors themselves: a tensor whose host form is a copy (a GPU's; on a CPU
    a bfloat16 one, which DLPack's numpy side lacks) is copied when its bytes are written, then let go, so that a save
    holds at most one such copy beside the state, not a copy of all of it (issue 58: a save doubled host memory)."""
    from host_memory import MIB, peak_added
    from safetensors import safe_open

    from ldm.checkpoint.format import weight_jobs

    layers = paddle.nn.Sequential(*[paddle.nn.Linear(2048, 2048) for _ in range(16)])
    layers.to(dtype="bfloat16")  # 8 MiB a weight, 128 MiB in all
    total = sum(int(t.numel()) * t.element_size() for t in layers.state_dict().values())

    def save() -> None:
        jobs, _ = weight_jobs({"unet": layers}, 0, 1, HostBuffers(copy=False))
        write_files(str(tmp_path), jobs, 0, 1)

    _, added = peak_added(save)
    # a tensor's copy, and Paddle's own on its way to numpy: a few tensors' worth, whatever the number of tensors
    assert added < 4 * 8 * MIB < total / 4, f"{added / MIB:.0f} MiB at the peak for {total / MIB:.0f} MiB of weights"
    with safe_open(str(tmp_path / "unet" / "diffusion_paddle_model.safetensors"), framework="numpy") as f:
        for name, tensor in layers.state_dict().items():
            np.testing.assert_array_equal(f.get_tensor(name), tensor.numpy())  # bfloat16 as its raw 16 bits
