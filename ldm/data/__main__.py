import sys

from ldm.prepare.tools import main

sys.exit(main())
