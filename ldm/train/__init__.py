"""Training: the objective both entry points share (`objective`), its batches (`batches`), gradient norms and
clipping (`gradients`), the metrics window (`metrics`), what is settled before the first write (`preflight`),
the run's state and when it is saved (`checkpointer`, `elastic`), the non-finite guard (`health`), stops
(`signals`), the hand-written loop (`loop`), the PaddleNLP Trainer subclass (`trainer`) and the autoencoder's
objective (`autoencoder`).

The top of the library: may use every other package of `ldm`.
"""
