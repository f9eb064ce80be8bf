"""`python -m ldm.prepare`: the corpus tools (`stats`, `plan`, `bench`, `convert`, `encode`, `synth`)."""

import sys

from ldm.prepare.tools import main

sys.exit(main())
