import sys

from ldm.launch.supervisor import main

sys.exit(main())
