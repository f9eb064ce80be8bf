"""Every shim of `ldm/compat.py` against the installed Paddle and PaddleNLP: what an upgrade would break
fails here first, and a missing private name is one error naming the supported versions."""

import numpy as np
import paddle
import pytest

from ldm import compat


def test_a_missing_private_name_is_one_error_naming_the_supported_versions():
    with pytest.raises(compat.CompatibilityError, match=r"needs GradScaler\._no_such_thing.*paddlenlp 2\.8\.1"):
        compat.private(paddle.amp.GradScaler(), "_no_such_thing", "a test")


def test_squared_l2_norm_is_the_sum_of_squares():
    values = np.random.default_rng(0).standard_normal((7, 5)).astype("float32")
    got = float(compat.squared_l2_norm(paddle.to_tensor(values)).reshape([]))
    assert got == pytest.approx(float((values.astype(np.float64) ** 2).sum()), rel=1e-5)


def test_loss_scale_is_the_factor_the_scaler_multiplies_by():
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0)  # disabled on a CPU: the factor is then 1
    assert float(compat.loss_scale(scaler)) == float(scaler.scale(paddle.to_tensor(1.0)))


def test_the_trainer_still_has_every_hook_ldm_trainer_overrides_or_calls():
    compat.check_trainer_hooks()
    from ldm.train.trainer import LDMTrainer

    overridden = {name for name in compat.TRAINER_HOOKS if name in vars(LDMTrainer)}
    assert overridden == {"_save", "_save_checkpoint", "_load_from_checkpoint", "_rotate_checkpoints"}


class Numbers(paddle.io.IterableDataset):
    def __iter__(self):
        yield from (np.full([2], i, dtype="float32") for i in range(8))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_iterators_have_what_stop_loader_uses(num_workers):
    compat.check_loader_classes()
    # the way ldm.data.dataset.build_dataloader makes its loaders
    loader = paddle.io.DataLoader(Numbers(), batch_size=None, num_workers=num_workers, use_shared_memory=False,
                                  timeout=compat.READER_POLL_SECONDS)
    iterator = iter(loader)
    try:
        next(iterator)
        names = compat.LOADER_ATTRIBUTES + (("_workers", "_data_queue") if num_workers else ())
        assert [name for name in names if not hasattr(iterator, name)] == []
    finally:
        thread = iterator._thread
        compat.stop_loader(iterator)
    assert not thread.is_alive()
