"""Turning user errors raised deep in the run into one readable line and exit status 2."""

from __future__ import annotations

import contextlib
import sys

from ldm.checkpoint.run_folder import NO_SPACE
from ldm.runtime import heartbeat
from ldm.runtime.errors import UserError


@contextlib.contextmanager
def user_errors():
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        heartbeat.note_cause(f"{type(e).__name__}: {e}")
        sys.exit(2)
    except OSError as e:
        if e.errno not in NO_SPACE:  # a checkpoint's own save says more (`RunFolder.no_space_ends_the_run`)
            raise
        heartbeat.note_cause(f"no space to write {e.filename or 'the run folder'}")
        print(f"error: no space to write {e.filename or 'the run folder'} ({e.strerror}): free space, then run the "
              "same command again (a run with checkpoints: with --resume_from_checkpoint auto)", file=sys.stderr)
        sys.exit(2)
