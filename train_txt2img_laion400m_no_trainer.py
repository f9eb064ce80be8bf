"""Training entry point (not implemented yet: see the open training issue)."""

import sys

if __name__ == "__main__":
    sys.exit("error: training is not implemented yet in this checkout; see README.md, 'Status'")
