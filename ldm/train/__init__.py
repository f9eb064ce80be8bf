"""Training building blocks shared by both entry points (`common`), the hand-written loop
(`loop`) and the PaddleNLP Trainer subclass (`trainer`)."""
