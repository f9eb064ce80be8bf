"""Turning user errors raised deep in the run into one readable line and exit status 2."""

from __future__ import annotations

import contextlib
import sys

from ldm.checkpoint.run_folder import NO_SPACE, CheckpointError
from ldm.checkpoint.serialization import StateFormatError
from ldm.config.record import ConfigError
from ldm.data.filelist import FileListError
from ldm.data.latents import LatentMismatch
from ldm.data.stream import NoUsableData
from ldm.data.tokenize import TokenizerError
from ldm.evaluation.clip import ClipError
from ldm.evaluation.fid import FIDError
from ldm.evaluation.inception import WeightsError
from ldm.models.buckets import BucketError
from ldm.models.build import ModelSourceError
from ldm.runtime.device import DeviceError
from ldm.runtime.tracking import TrackerError
from ldm.train.health import NonFiniteStop


@contextlib.contextmanager
def user_errors():
    try:
        yield
    except (BucketError, CheckpointError, FileListError, LatentMismatch, NoUsableData, TokenizerError, ModelSourceError,
            TrackerError, StateFormatError, ConfigError, DeviceError, NonFiniteStop, FIDError, WeightsError,
            ClipError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in NO_SPACE:  # a checkpoint's own save says more (`RunFolder.no_space_ends_the_run`)
            raise
        print(f"error: no space to write {e.filename or 'the run folder'} ({e.strerror}): free space, then run the "
              "same command again (a run with checkpoints: with --resume_from_checkpoint auto)", file=sys.stderr)
        sys.exit(2)
