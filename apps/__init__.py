"""Applications built on the `ldm` library, not part of it: the offline end-to-end demo (`apps.demo`,
run by `bash scripts/demo.sh`) and the captioned-shapes evaluation (`python -m apps.eval`)."""
