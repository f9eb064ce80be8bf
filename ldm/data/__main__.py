"""`python -m ldm.data`, the corpus tools' earlier spelling: it runs `python -m ldm.prepare` by name. An import of
`ldm.prepare` here would make `ldm.data` depend on the package built on top of it (a cycle)."""

import runpy

runpy.run_module("ldm.prepare", run_name="__main__", alter_sys=True)
