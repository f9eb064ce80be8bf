"""Every metric of a model: the held-out loss (`heldout`), FID (`fid`, on the FID Inception of `inception`), CLIP
score (`clip`), and generating and scoring images (`generated`), checked against pytorch-fid, clean-fid and
transformers (tests/reference/make_eval_fixtures.py). The command line is `python -m ldm.evaluate`.

Submodules are imported on demand: importing this package does not import Paddle.
May use `ldm.runtime`, `ldm.models`, `ldm.checkpoint`, `ldm.data` and `ldm.inference`.
"""
