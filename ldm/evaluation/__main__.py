"""`python -m ldm.evaluation`: the same command line as `python -m ldm.evaluate`."""

import sys

from ldm.evaluation.cli import main

sys.exit(main())
