"""Image-generation metrics computed offline: FID (`ldm.evaluation.fid`, on the FID Inception of
`ldm.evaluation.inception`) and CLIP score (`ldm.evaluation.clip`), checked against pytorch-fid, clean-fid and
transformers (tests/reference/make_eval_fixtures.py). The command line is `python -m ldm.evaluate`.

Submodules are imported on demand: importing this package does not import Paddle.
"""
