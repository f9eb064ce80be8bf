# Settings both paths take the same way, appended to ARGS by scripts/no_trainer_args.sh and
# scripts/trainer_args.sh (sourced from the repository root).
# REPORT_TO: trackers, e.g. "visualdl" (default), "tensorboard wandb", "none".
read -r -a _report_to <<< "${REPORT_TO:-visualdl}"
ARGS+=(--report_to "${_report_to[@]}")
# VAE: a pretrained autoencoder (a folder, or a hub name such as CompVis/ldm-text2im-large-256/vqvae). The
# presets carry none, and a run refuses to train on an untrained one.
if [[ -n "${VAE:-}" ]]; then
    ARGS+=(--vae_name_or_path "$VAE")
fi
