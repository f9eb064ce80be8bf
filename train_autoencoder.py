"""Train the KL autoencoder whose latents the diffusion model learns (on the same shards).

    python train_autoencoder.py --help
    python train_autoencoder.py --model_name_or_path ldm-32layer --file_list ./data/filelist/train.filelist.list \
        --output_dir ./outputs/autoencoder --resolution 256 --train_batch_size 12 --max_train_steps 100000
    python train_txt2img_laion400m_no_trainer.py --vae_name_or_path ./outputs/autoencoder/vqvae ...

Runs on one card or many (`python -m paddle.distributed.launch`), with the hand-written loop's
flags (checkpoints, --resume_from_checkpoint, logging). Captions are not read.
"""

from ldm.config.args import AutoencoderArguments, AutoencoderLoopArguments, DataArguments, RunArguments, parse


def main(argv=None) -> int:
    args, data_args, loop_args, run_args = parse(
        [AutoencoderArguments, DataArguments, AutoencoderLoopArguments, RunArguments], argv)
    from ldm.runtime.device import use_fast_cpu_kernels
    from ldm.train.autoencoder import train
    from ldm.train.errors import user_errors

    use_fast_cpu_kernels()
    with user_errors():
        result = train(loop_args, args, data_args, run_args)
    return result["exit_code"]  # 128 + signal number after a graceful stop


if __name__ == "__main__":
    from ldm.runtime.distributed import run_main

    run_main(main)
