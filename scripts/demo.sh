#!/usr/bin/env bash
# The main job: 2 workers on localhost train a convnet with MultiWorkerMirroredStrategy,
# writing sharded, verified checkpoints. Creates .venv and installs tfdp first if needed.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_venv.sh
tfdp_venv "" if_missing

MODEL_DIR="${MODEL_DIR:-$PWD/runs/demo}"
rm -rf "$MODEL_DIR"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

echo "==> training: 2 workers x 1 CPU replica, MultiWorkerMirroredStrategy (RING all-reduce)"
.venv/bin/tfdp-launch --num_workers=2 -- \
  .venv/bin/tfdp-train \
    --model=cnn --dataset=synthetic \
    --strategy=multi_worker --all_reduce=ring \
    --global_batch_size=64 --train_steps=600 --steps_per_epoch=100 \
    --learning_rate=0.05 --seed=0 --deterministic \
    --checkpoint_every_steps=200 --async_checkpoint \
    --model_dir="$MODEL_DIR"

echo
echo "==> checkpoints in $MODEL_DIR"
.venv/bin/tfdp-ckpt ls "$MODEL_DIR"
LATEST="$(.venv/bin/python -c "import sys, tensorflow as tf; print(tf.train.latest_checkpoint(sys.argv[1]))" "$MODEL_DIR" 2>/dev/null)"
.venv/bin/tfdp-ckpt verify "$LATEST"
echo
echo "Latest checkpoint: $LATEST"
echo "Run the tfdp-launch line above again with a larger --train_steps and it resumes there."
echo "TensorBoard logs: $MODEL_DIR/logs"
