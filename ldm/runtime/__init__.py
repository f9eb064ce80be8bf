"""What a process of this project runs on: ranks and collectives (`distributed`), the private Paddle and PaddleNLP
APIs it uses, each checked (`compat`), CPU kernel choice and precision (`cpu`, `device`), the trackers and the
metrics file (`tracking`), the parser every command shares (`cli`), a command's outputs written whole or not
at all (`files`), the one definition of a user error (`errors`) and the update's one vote, which the non-finite
guard, the graceful stop and the checkpoint manager cast their ballots in (`vote`).

The bottom of the package: imports nothing of `ldm`.
"""
