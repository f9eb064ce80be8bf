#!/usr/bin/env bash
# One node of scripts/slurm/pretrain.sbatch (srun runs it once per node): that node's python -m ldm.launch, which
# starts a rank per card and meets the other nodes at MASTER_ADDR:MASTER_PORT.
set -euo pipefail
if [[ "${TRAINER:-0}" == 1 ]]; then
    source scripts/trainer_args.sh
    script=train_txt2img_laion400m_trainer.py
else
    source scripts/no_trainer_args.sh
    script=train_txt2img_laion400m_no_trainer.py
fi
cards="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
logs="${LOG_DIR:-./log_slurm}/node${SLURM_NODEID}"
mkdir -p "$logs"
echo $$ > "$logs/ldm-launch.pid"  # the batch script's stop signals it (exec keeps the pid)
exec "$PYTHON" -m ldm.launch --max_restarts "${MAX_RESTARTS:-3}" \
    --nnodes "$SLURM_NNODES" --rank "$SLURM_NODEID" --master "${MASTER_ADDR}:${MASTER_PORT}" \
    --nproc_per_node "$cards" --log_dir "$logs" \
    "$script" "${ARGS[@]}" --resume_from_checkpoint auto "$@"
