"""Exponential moving average of every trained weight (UNet and text encoder)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import paddle
from paddle import nn


class EMA:
    """decay_n = min(max_decay, (1 + n) / (10 + n)) at update n: a warm-up, so early weights fade fast.

    The update counter is part of the state: a resumed run continues the same decay schedule.
    """

    def __init__(self, model: nn.Layer, decay: float = 0.9999):
        self.max_decay = decay
        self.parameters = {n: p for n, p in model.named_parameters() if not p.stop_gradient}
        self.shadow = {n: p.detach().astype("float32").clone() for n, p in self.parameters.items()}
        self.num_updates = 0
        self.owner: dict[str, int] | None = None  # sharded: weight name -> the rank that keeps its average
        self.rank = 0
        self._broadcast: Callable[[paddle.Tensor, int], None] | None = None
        self._gathered = False
        # the averages as views into flat buffers, and their update in one pass (`ldm.train.flat.FlatEMA`, after
        # `shard`); None: tensor by tensor
        self.flat = None

    def _put(self, name: str, tensor: paddle.Tensor) -> None:
        """Average `name` := `tensor` (a float32 tensor of its own); in place when flat (its average is a view into
        the flat buffer)."""
        if self.flat is not None:
            paddle.assign(tensor.reshape(self.shadow[name].shape), output=self.shadow[name])
        else:
            self.shadow[name] = tensor

    def shard(self, owner: dict[str, int], rank: int, broadcast: Callable[[paddle.Tensor, int], None]) -> None:
        """Keep only the averages of the weights this rank owns (those whose optimizer state it keeps):
        `broadcast(tensor, owner_rank)` sends an owner's tensor to the other ranks of its group (`gathered`)."""
        self.owner, self.rank, self._broadcast = dict(owner), rank, broadcast
        self.shadow = {n: t for n, t in self.shadow.items() if self.owner[n] == rank}

    @contextmanager
    def gathered(self):
        """Every average on every rank for the time of the block (validation, images, FID see the whole EMA), then
        freed. A collective: every rank of the group enters it. Unsharded, nothing to do."""
        if self.owner is None or self._gathered:
            yield self
            return
        mine, everything = self.shadow, {}
        for name in sorted(self.parameters):  # the same order on every rank
            owner = self.owner[name]
            tensor = mine[name] if owner == self.rank else paddle.empty(self.parameters[name].shape, "float32")
            self._broadcast(tensor, owner)
            everything[name] = tensor
        self.shadow, self._gathered = everything, True
        try:
            yield self
        finally:
            self.shadow, self._gathered = mine, False

    @paddle.no_grad()
    def reset_to(self, model: nn.Layer) -> None:
        """Start over from `model`'s weights (a new stage from weights without an EMA of their own)."""
        named = dict(model.named_parameters())
        for name in list(self.shadow):
            self._put(name, named[name].detach().astype("float32").clone())
        self.num_updates = 0

    def load_matching(self, state: dict) -> None:
        """The update counter and the averages `state` holds of this EMA's weights; the others stay as they are."""
        self.num_updates = int(state["num_updates"])
        for name in self.shadow:
            if f"shadow.{name}" in state:
                self._put(name, paddle.to_tensor(state[f"shadow.{name}"], dtype="float32"))

    def decay(self, update: int | None = None) -> float:
        """The decay of update `update` (default: the last one counted)."""
        n = self.num_updates if update is None else update
        return min(self.max_decay, (1 + n) / (10 + n))

    @paddle.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        decay = self.decay()
        if self.flat is not None:
            self.flat.update(decay)
            return
        for name, shadow in self.shadow.items():
            parameter = self.parameters[name]
            shadow.scale_(decay)
            shadow.add_(parameter.detach().astype("float32") * (1.0 - decay))

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "max_decay": self.max_decay,
                **{f"shadow.{n}": t for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = int(state["num_updates"])
        missing = [n for n in self.shadow if f"shadow.{n}" not in state]
        if missing:
            raise KeyError(f"EMA state lacks {len(missing)} weights, e.g. {missing[:3]}")
        for name in self.shadow:
            self._put(name, paddle.to_tensor(state[f"shadow.{name}"], dtype="float32"))

    @paddle.no_grad()
    def copy_to(self, model: nn.Layer) -> None:
        """Write the averaged weights into `model` (same parameter names)."""
        for name, parameter in model.named_parameters():
            if name in self.shadow:
                parameter.set_value(self.shadow[name].astype(parameter.dtype))

    @contextmanager
    def swapped(self, model: nn.Layer):
        """Temporarily run `model` with the EMA weights (for sampling during training); sharded, within
        `gathered`."""
        if self.owner is not None and not self._gathered:
            raise RuntimeError("a sharded EMA is swapped in within EMA.gathered() (a collective)")
        backup = {n: p.detach().clone() for n, p in model.named_parameters() if n in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with paddle.no_grad():
                for name, parameter in model.named_parameters():
                    if name in backup:
                        parameter.set_value(backup[name])
