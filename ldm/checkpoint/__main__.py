"""`python -m ldm.checkpoint upgrade DIR`: checkpoints of an earlier version (pickles) rewritten in today's format."""

import sys

from ldm.checkpoint.format import main

sys.exit(main())
