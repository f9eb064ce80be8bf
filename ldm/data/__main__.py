import sys

from ldm.data.tools import main

sys.exit(main())
