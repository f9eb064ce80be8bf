"""What a process of this project runs on: ranks and collectives (`distributed`), the private Paddle and PaddleNLP
APIs it uses, each checked (`compat`), CPU kernel choice and precision (`cpu`, `device`), the trackers and the
metrics file (`tracking`), the parser every command shares (`cli`), a command's outputs written whole or not
at all (`files`), the one definition of a user error (`errors`), the update's one vote, which the non-finite
guard, the graceful stop and the checkpoint manager cast their ballots in (`vote`), what a rank tells `ldm.launch`
(`heartbeat`) and the caches Paddle's libraries make under HOME, moved aside where it is read-only (`home`).

The bottom of the package: imports nothing of `ldm`.
"""
