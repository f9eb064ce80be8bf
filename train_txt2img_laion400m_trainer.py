"""Pretrain a text-to-image latent diffusion model with the PaddleNLP Trainer.

    python train_txt2img_laion400m_trainer.py --do_train --output_dir OUT ... (or --config FILE.yaml|.json)
    python -m paddle.distributed.launch --gpus 0,1,2,3 train_txt2img_laion400m_trainer.py ...
"""

import sys

from ldm.config.args import (
    DataArguments,
    ModelArguments,
    RunArguments,
    SamplingArguments,
    ValidationArguments,
    parse,
    trainer_arguments,
)


def main(argv=None) -> int:
    model_args, data_args, sampling_args, training_args, run_args, validation_args = parse(
        [ModelArguments, DataArguments, SamplingArguments, trainer_arguments(), RunArguments, ValidationArguments],
        argv)
    if not training_args.do_train:
        sys.exit("error: nothing to do: pass --do_train")
    from ldm.runtime.device import use_fast_cpu_kernels
    from ldm.train.errors import user_errors
    from ldm.train.trainer import train

    use_fast_cpu_kernels()
    with user_errors():
        result = train(training_args, model_args, data_args, sampling_args, run_args, validation_args)
    return result["exit_code"]  # 128 + signal number after a graceful stop


if __name__ == "__main__":
    from ldm.runtime.distributed import run_main

    run_main(main)
