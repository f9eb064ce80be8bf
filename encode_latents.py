"""Encode a caption-image corpus once with the frozen autoencoder: `python -m ldm.prepare encode`, as a script
that `paddle.distributed.launch` can start (it takes a script path, not a module).

    python encode_latents.py --file_list F --vae_name_or_path V --output_dir D [--random_flip]
    python -m paddle.distributed.launch --gpus 0,1,2,3 encode_latents.py --file_list F ...
"""

import sys

from ldm.prepare.tools import main

if __name__ == "__main__":
    sys.exit(main(["encode", *sys.argv[1:]]))
