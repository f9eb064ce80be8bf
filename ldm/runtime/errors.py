"""The one definition of a user error: what the user corrects by changing a flag, a file or the environment. Every
command ends on one (a subclass, raised anywhere below it) with one line, `error: <message>`, and exit status 2,
never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """An error the user can correct; its message says what to do. Subclasses keep a built-in base too (ValueError,
    OSError, ...) where callers already catch that."""


class NonFiniteStop(UserError, RuntimeError):
    """The run cannot go on: updates keep failing, or the weights themselves are no longer finite (raised by the
    non-finite guard, `ldm.train.health`, and by the checkpoint manager, which never saves such weights)."""
