"""Pretrain a text-to-image latent diffusion model with a hand-written loop.

    python train_txt2img_laion400m_no_trainer.py --help
    python train_txt2img_laion400m_no_trainer.py --config run.yaml [--flag value ...]
    python -m paddle.distributed.launch --gpus 0,1,2,3 train_txt2img_laion400m_no_trainer.py ...
"""

from ldm.config.args import NO_TRAINER_GROUPS, parse


def main(argv=None) -> int:
    model_args, data_args, sampling_args, loop_args, run_args, validation_args = parse(NO_TRAINER_GROUPS, argv)
    from ldm.runtime.device import use_fast_cpu_kernels
    from ldm.train.errors import user_errors
    from ldm.train.loop import train

    use_fast_cpu_kernels()
    with user_errors():
        result = train(loop_args, model_args, data_args, sampling_args, run_args, validation_args)
    return result["exit_code"]  # 128 + signal number after a graceful stop


if __name__ == "__main__":
    from ldm.runtime.distributed import run_main

    run_main(main)
