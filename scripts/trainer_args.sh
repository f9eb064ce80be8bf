# The Trainer path's arguments with the original documentation's defaults, each overridable by an
# environment variable. Sourced by run_single_trainer.sh and run_multi_trainer.sh.
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}"
ARGS=(
    --do_train
    --output_dir "${OUTPUT_DIR:-./laion400m_pretrain_output_trainer}"
    --per_device_train_batch_size "${PER_DEVICE_TRAIN_BATCH_SIZE:-6}"
    --gradient_accumulation_steps "${GRADIENT_ACCUMULATION_STEPS:-10}"
    --learning_rate "${LEARNING_RATE:-4.6875e-5}"
    --weight_decay "${WEIGHT_DECAY:-0.02}"
    --max_steps "${MAX_STEPS:-1000000000}"
    --lr_scheduler_type "${LR_SCHEDULER_TYPE:-constant}"
    --warmup_steps "${WARMUP_STEPS:-0}"
    --logging_steps "${LOGGING_STEPS:-50}"
    --save_steps "${SAVE_STEPS:-5000}"
    --save_total_limit "${SAVE_TOTAL_LIMIT:-50}"
    --dataloader_num_workers "${DATALOADER_NUM_WORKERS:-6}"
    --model_name_or_path "${MODEL:-ldm-32layer}"
    --file_list "${FILE_LIST:-./data/filelist/train.filelist.list}"
    --num_inference_steps "${NUM_INFERENCE_STEPS:-200}"
    --tokenizer_name "${TOKENIZER_NAME:-bert-base-uncased}"
)
source scripts/common_args.sh
# MODEL_MAX_LENGTH only when set: unset, the model's own caption length (77 for LDMBert and CLIP)
if [[ -n "${MODEL_MAX_LENGTH:-}" ]]; then ARGS+=(--model_max_length "$MODEL_MAX_LENGTH"); fi
# SEED only when set: unset, a run starts with the recipe's 23 and a resume keeps its checkpoint's seed
if [[ -n "${SEED:-}" ]]; then ARGS+=(--seed "$SEED"); fi
