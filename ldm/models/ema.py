"""Exponential moving average of every trained weight (UNet and text encoder)."""

from __future__ import annotations

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

    @paddle.no_grad()
    def reset_to(self, model: nn.Layer) -> None:
        """Start over from `model`'s weights (a new stage from weights without an EMA of their own)."""
        named = dict(model.named_parameters())
        self.shadow = {n: named[n].detach().astype("float32").clone() for n in self.shadow}
        self.num_updates = 0

    def load_matching(self, state: dict) -> None:
        """The update counter and the averages `state` holds of this EMA's weights; the others stay as they are."""
        self.num_updates = int(state["num_updates"])
        for name in self.shadow:
            if f"shadow.{name}" in state:
                self.shadow[name] = paddle.to_tensor(state[f"shadow.{name}"], dtype="float32")

    def decay(self) -> float:
        return min(self.max_decay, (1 + self.num_updates) / (10 + self.num_updates))

    @paddle.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        decay = self.decay()
        for name, parameter in self.parameters.items():
            shadow = self.shadow[name]
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
            self.shadow[name] = paddle.to_tensor(state[f"shadow.{name}"], dtype="float32")

    @paddle.no_grad()
    def copy_to(self, model: nn.Layer) -> None:
        """Write the averaged weights into `model` (same parameter names)."""
        for name, parameter in model.named_parameters():
            if name in self.shadow:
                parameter.set_value(self.shadow[name].astype(parameter.dtype))

    @contextmanager
    def swapped(self, model: nn.Layer):
        """Temporarily run `model` with the EMA weights (for sampling during training)."""
        backup = {n: p.detach().clone() for n, p in model.named_parameters() if n in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with paddle.no_grad():
                for name, parameter in model.named_parameters():
                    if name in backup:
                        parameter.set_value(backup[name])
