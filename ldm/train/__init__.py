"""Training: what both entry points share (`setup`, `batches`, `optim`, `samples`, `signals`), the
hand-written loop (`loop`) and the PaddleNLP Trainer subclass (`trainer`)."""
