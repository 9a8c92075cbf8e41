#!/usr/bin/env bash
# The main job: 2 workers on localhost train a convnet with MultiWorkerMirroredStrategy,
# writing sharded, verified checkpoints. Creates .venv and installs tfdp first if needed.
# Ends by printing the command that continues the run from its last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_venv.sh
tfdp_venv "" if_missing

# Relative to the repo root, where the printed command is to be run.
MODEL_DIR="${MODEL_DIR:-runs/demo}"
TRAIN_STEPS="${TRAIN_STEPS:-600}"
rm -rf "$MODEL_DIR"

# The job's command line without --train_steps: run here, then printed with a larger one.
JOB=(.venv/bin/tfdp-launch --num_workers=2 --
     .venv/bin/tfdp-train
       --model=cnn --dataset=synthetic
       --strategy=multi_worker --all_reduce=ring
       --global_batch_size=64 --steps_per_epoch=100
       --learning_rate=0.05 --seed=0 --deterministic
       --checkpoint_every_steps=200 --async_checkpoint
       --model_dir="$MODEL_DIR")

echo "==> training: 2 workers x 1 CPU replica, MultiWorkerMirroredStrategy (RING all-reduce)"
"${JOB[@]}" --train_steps="$TRAIN_STEPS"

echo
echo "==> checkpoints in $MODEL_DIR"
# tfdp-ckpt runs outside tfdp-launch, whose filter kept TF's C++ start-up lines out of the training.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
.venv/bin/tfdp-ckpt ls "$MODEL_DIR"
LATEST="$(.venv/bin/python -c "import sys, tensorflow as tf; print(tf.train.latest_checkpoint(sys.argv[1]))" "$MODEL_DIR" 2>/dev/null)"
.venv/bin/tfdp-ckpt verify "$LATEST"
echo
echo "Latest checkpoint: $LATEST"
echo "TensorBoard logs: $MODEL_DIR/logs"
echo
echo "==> to continue from step $TRAIN_STEPS to $((TRAIN_STEPS * 2)), run from $PWD:"
# printf %q quotes each word so that the line pastes back into a shell as it is.
printf '%q ' "${JOB[@]}" --train_steps=$((TRAIN_STEPS * 2))
echo
