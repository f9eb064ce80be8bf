"""Training: one run's life, whichever driver runs the updates (`run`: set-up, the update's vote, logging,
evaluation, checkpoints, stops, teardown), and its two drivers: the hand-written loop (`loop`) and the PaddleNLP
Trainer's hooks (`trainer`). Below them: what a run trains (`objective`, and the autoencoder's: `autoencoder`), its
batches (`batches`), gradient norms and clipping (`gradients`), the metrics window (`metrics`), what is settled
before the first write (`preflight`), the clock of samples for a resume on another global batch (`elastic`), the
non-finite guard (`health`), stops (`signals`), progress output (`progress`) and the memory record (`memory`).
Saving and resuming are `ldm.checkpoint.manager`'s.

The top of the library: may use every other package of `ldm`.
"""
