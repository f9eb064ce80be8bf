"""Print the parameter count of every part of each preset (builds them on the CPU).

    .venv/bin/python scripts/model_report.py [preset ...]
"""

import logging
import sys
import time

from ldm.models.build import PRESETS, build_components

logging.getLogger("ldm.models").setLevel(logging.ERROR)
for preset in sys.argv[1:] or PRESETS:
    start = time.perf_counter()
    components = build_components(preset, vocab_size=30522, model_max_length=77)
    counts = components.parameter_counts()
    trained = sum(int(p.numel()) for p in components.text_encoder.model.parameters())
    print(f"{preset:12s} unet {counts['unet'] / 1e6:8.2f}M  text encoder {trained / 1e6:8.2f}M "
          f"(+ unused to_logits head {(counts['text_encoder'] - trained) / 1e6:.2f}M)  "
          f"vae {counts['vae'] / 1e6:7.2f}M  [{time.perf_counter() - start:.0f} s]", flush=True)
    del components
