"""The update's vote: the one collective and the one host read every optimizer update makes.

Several parts of a run must agree at each update, the same on every rank: the non-finite guard (was this update's
loss or gradient norm not finite? by how much to clip?), the graceful stop (was any rank signalled?) and the
checkpoint manager (is a rank still writing the save in flight? did one fail?). Each casts named ballots; the
vote reduces them all with MAX in one all-reduce and brings them to the host in one read. A ballot is a number on
the host or a one-element tensor on the device (read along, without a synchronisation of its own). No part owns
the vote: each only reads the outcome under the names it cast.

One process reads its device ballots in the same single read, and its host ballots are its own.
"""

from __future__ import annotations


class UpdateVote:
    def __init__(self, world_size: int):
        self.world_size = world_size

    def cast(self, ballots: dict) -> dict[str, float]:
        """Every rank's largest value of each ballot, by name; every rank calls this at the same update with the
        same names in the same order."""
        import paddle

        names = list(ballots)
        on_device = [name for name in names if isinstance(ballots[name], paddle.Tensor)]
        on_host = [name for name in names if name not in on_device]
        if self.world_size == 1:
            read = paddle.concat([ballots[n].astype("float32").reshape([1]) for n in on_device]).numpy().tolist() \
                if on_device else []
            return {**dict(zip(on_device, read, strict=True)), **{name: float(ballots[name]) for name in on_host}}
        parts = [ballots[n].astype("float32").reshape([1]) for n in on_device]
        if on_host:
            parts.append(paddle.to_tensor([float(ballots[n]) for n in on_host], dtype="float32"))
        flags = paddle.concat(parts)
        paddle.distributed.all_reduce(flags, op=paddle.distributed.ReduceOp.MAX)
        return dict(zip(on_device + on_host, flags.numpy().tolist(), strict=True))
