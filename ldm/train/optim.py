"""The hand-written loop's learning-rate schedule (the Trainer path builds its own, the same way)."""

from __future__ import annotations

from paddlenlp.trainer.trainer_utils import get_scheduler


def lr_schedule(name: str, learning_rate: float, warmup_steps: int, total_steps: int):
    """PaddleNLP's schedules, counted in optimizer updates."""
    return get_scheduler(name, learning_rate=learning_rate, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps)
