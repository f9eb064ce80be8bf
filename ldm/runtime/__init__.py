"""What a process of this project runs on: ranks and collectives (`distributed`), the private Paddle and PaddleNLP
APIs it uses, each checked (`compat`), CPU kernel choice and precision (`cpu`, `device`), the trackers and the
metrics file (`tracking`), the parser every command shares (`cli`), and a command's outputs written whole or not
at all (`files`).

The bottom of the package: imports nothing of `ldm`.
"""
