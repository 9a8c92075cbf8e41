"""`tfdp-train`: absl flags -> TrainConfig -> tfdp.app.trainer.run.

Flags, paths and the cluster are checked before TensorFlow is imported: a
bad one costs a fraction of a second and prints one line, no TF start-up.
"""

import dataclasses
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tfdp.distribute import environment
from tfdp import errors
from tfdp.distribute import kinds as strategy_kind

FLAGS = flags.FLAGS

flags.DEFINE_string("model", "cnn", "Model name from the models registry.")
flags.DEFINE_string("dataset", "synthetic",
                    "synthetic (a learnable signal for every model), "
                    "tfds:NAME[:CONFIG] (prepared under --data_dir; never "
                    "downloaded) or text:PATH (a local corpus, one example "
                    "a line; --model=bert).")
flags.DEFINE_enum("strategy", "auto", list(strategy_kind.KINDS),
                  "Distribution strategy; auto picks from TF_CONFIG, GPUs and "
                  "--cpu_replicas.")
flags.DEFINE_integer("cpu_replicas", None,
                     "Split the CPU into this many logical devices and mirror "
                     "over them (replicas per worker under multi_worker).",
                     lower_bound=1)
flags.DEFINE_enum("all_reduce", "auto", list(strategy_kind.ALL_REDUCE),
                  "Gradient all-reduce implementation.")
flags.DEFINE_float("collective_timeout", None,
                   "Seconds a collective may wait before the worker fails with a line naming "
                   "it and the step (multi-worker; default: 600).", lower_bound=0.001)
flags.DEFINE_enum("gradient_compression", "none", ["none", "bf16", "fp16"],
                  "All-reduce float32 gradients as this dtype (cast back after).")
flags.DEFINE_float("bucket_cap_mb", 25.0,
                   "Gradients are all-reduced in buckets of this many MB, last layers first, "
                   "so communication overlaps the backward pass (0: one all-reduce).",
                   lower_bound=0.0)
flags.DEFINE_integer("bytes_per_pack", None,
                     "Pack gradients into all-reduces of this many bytes (0: "
                     "one pack; default: 4 MB for ring collectives, one pack "
                     "for NCCL).", lower_bound=0)
flags.DEFINE_integer("global_batch_size", 32,
                     "Examples per step across all replicas; must divide by "
                     "the replica count.")
flags.DEFINE_integer("train_steps", 100, "Global step to train to.")
flags.DEFINE_integer("steps_per_epoch", None,
                     "Steps per Keras epoch (default: one pass over the data).")
flags.DEFINE_float("learning_rate", None,
                   "Peak learning rate, absolute (default: the model's; "
                   "cnn 0.05, resnets 0.1 per 256 examples, bert 1e-3, dlrm 1e-3).")
flags.DEFINE_float("base_learning_rate", None,
                   "Peak learning rate per 256 examples, scaled linearly "
                   "with --global_batch_size (Goyal et al.).")
flags.DEFINE_integer("warmup_steps", 0,
                     "Steps of linear learning-rate warmup from 0.",
                     lower_bound=0)
flags.DEFINE_enum("lr_decay", "constant", ["constant", "cosine", "linear"],
                  "Learning-rate decay after warmup, to 0 at --train_steps.")
flags.DEFINE_enum("optimizer", "auto", ["auto", "sgd", "adamw", "adam"],
                  "auto: the model's (momentum SGD; AdamW for bert; Adam "
                  "for dlrm).")
flags.DEFINE_float("momentum", 0.9, "Momentum of SGD.")
flags.DEFINE_float("weight_decay", None,
                   "L2 weight decay for sgd (in the gradient, as Goyal et "
                   "al.), decoupled for adamw; biases and normalisation "
                   "parameters exempt (default: the model's; resnets 1e-4).")
flags.DEFINE_float("label_smoothing", 0.0,
                   "Label smoothing of the classification loss.")
flags.DEFINE_bool("mixed_precision", False,
                  "Compute in mixed_float16 on GPUs, mixed_bfloat16 on "
                  "CPUs; variables stay float32.")
flags.DEFINE_integer("seed", 0, "Seed of every random choice of the run.")
flags.DEFINE_bool("deterministic", False,
                  "Enable TF op determinism (bitwise repeatable on CPU).")
flags.DEFINE_string("model_dir", None,
                    "Checkpoints and TensorBoard logs go here; a run resumes "
                    "from the newest intact checkpoint in it.")
flags.DEFINE_integer("checkpoint_every_steps", None,
                     "Save a checkpoint every N global steps (and always at "
                     "the end).", lower_bound=0)
flags.DEFINE_bool("async_checkpoint", False,
                  "Write checkpoints in the background; training blocks only "
                  "for the copy to host memory.")
flags.DEFINE_string("local_checkpoint_every_steps", None,
                    "Also save every N steps to a local tier on each host (in "
                    "RAM, under /dev/shm, unless --local_checkpoint_dir), or "
                    "'auto': as often as --checkpoint_overhead allows, down to "
                    "every step. A restart resumes from the newest step any "
                    "worker holds; a worker that lost it gets it from a peer.")
flags.register_validator(
    "local_checkpoint_every_steps",
    lambda v: v is None or v == "auto" or (v.isdigit() and int(v) >= 1),
    message="--local_checkpoint_every_steps takes a positive number of steps or 'auto'")
flags.DEFINE_float("checkpoint_overhead", 0.02,
                   "With --local_checkpoint_every_steps=auto: the share of the "
                   "training time local saves may cost (their blocked time and "
                   "their writer's CPU).", lower_bound=0.0001, upper_bound=0.9)
flags.DEFINE_string("local_checkpoint_dir", None,
                    "The local tier's per-host directory (default with "
                    "--local_checkpoint_every_steps: $XDG_RUNTIME_DIR/tfdp/<hash of "
                    "--model_dir>, or /dev/shm/tfdp-<uid>/<hash>; private to the user).")
flags.DEFINE_integer("max_to_keep", 5, "Checkpoints to keep.", lower_bound=1)
flags.DEFINE_integer("max_shard_bytes", None,
                     "Cap on each checkpoint data file a worker writes.",
                     lower_bound=1)
flags.DEFINE_bool("allow_config_mismatch", False,
                  "Resume from a checkpoint of a run with another global "
                  "batch size, dataset or seed.")
flags.DEFINE_float("preemption_grace_seconds", 25.0,
                   "After SIGTERM/SIGINT to any worker, all workers save at "
                   "the next step they agree on and exit with code 75; a "
                   "worker still running this many seconds after the signal "
                   "exits with code 143 (0: wait forever). Needs --model_dir.")
flags.DEFINE_integer("num_examples", 2048, "Size of the synthetic dataset.",
                     lower_bound=1)
flags.DEFINE_string("data_dir", None,
                    "TFDS data directory (default: TFDS's, ~/tensorflow_datasets).")
flags.DEFINE_integer("image_size", None,
                     "Side of the images fed to the model (default: the "
                     "model's; resnet50 and keras_app 224, others 32).",
                     lower_bound=8)
flags.DEFINE_enum("bert_config", "tiny", ["tiny", "mini", "small", "base"],
                  "BERT size for --model=bert (base: the 110M-parameter "
                  "encoder).")
flags.DEFINE_string("vocab_file", None,
                    "WordPiece vocabulary (BERT vocab.txt) of text datasets.")
flags.DEFINE_integer("seq_len", 128, "Tokens per masked-LM sequence.",
                     lower_bound=8)
flags.DEFINE_integer("eval_every_steps", None,
                     "Evaluate whenever the global step reaches a multiple of N, "
                     "and at --train_steps: model.evaluate under the training "
                     "strategy on --eval_split; the metrics (val_loss, ...) go "
                     "to the log and to TensorBoard at the global step, and "
                     "are stored with the checkpoints for --keep_best "
                     "(default: no evaluation).", lower_bound=0)
flags.DEFINE_integer("eval_steps", None,
                     "Batches of --global_batch_size per evaluation, the same "
                     "ones each time (default: one pass over --eval_split).",
                     lower_bound=1)
flags.DEFINE_string("eval_split", None,
                    "Split to evaluate on (default: the dataset's held-out "
                    "split). synthetic: test (examples disjoint from train, "
                    "a quarter of --num_examples); tfds: test, else "
                    "validation, or any split the dataset was prepared with; "
                    "text: test (the last 10% of the corpus's lines; training "
                    "then uses the first 90%), or train[P%:] (training on "
                    "train[:P%]).")
flags.DEFINE_string("keep_best", None,
                    "METRIC:min|max:K, e.g. val_loss:min:3: besides the newest "
                    "--max_to_keep checkpoints, keep the K best by METRIC "
                    "(val_* metrics need --eval_every_steps, and "
                    "--checkpoint_every_steps a multiple of it).")
flags.DEFINE_integer("summary_every_steps", None,
                     "Write TensorBoard batch summaries (loss, metrics, "
                     "examples/s) every N global steps (default: a quarter "
                     "epoch).", lower_bound=1)


def config_from_flags():
  """The TrainConfig the parsed flags describe."""
  from tfdp.app.trainer import TrainConfig  # pylint: disable=g-import-not-at-top
  return TrainConfig(**{f.name: FLAGS[f.name].value
                        for f in dataclasses.fields(TrainConfig)})


def _local(path):
  return path and "://" not in path


def check_paths():
  """Raises ConfigError for a --model_dir or --data_dir no run can use (before TF starts)."""
  model_dir = FLAGS.model_dir
  if _local(model_dir):
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
      raise errors.ConfigError(
          f"--model_dir={model_dir} is a file, not a directory; pass a directory "
          "(it is created if missing).")
    parent = os.path.abspath(model_dir)
    while not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
      raise errors.ConfigError(
          f"--model_dir={model_dir} cannot be created or written ({parent} is not a "
          "writable directory); pass a writable path.")
  data_dir = FLAGS.data_dir
  if _local(data_dir) and not os.path.isdir(data_dir):
    raise errors.ConfigError(
        f"--data_dir={data_dir} is not a directory; pass the folder the dataset "
        "was prepared in (see scripts/make_dataset.py).")


def check_cluster():
  """Raises ConfigError for a bad TF_CONFIG or SLURM step, or a --strategy the cluster contradicts."""
  _, config = environment.resolve_cluster("auto")
  workers = None if config is None else environment.num_cluster_workers(config)
  strategy_kind.check_cluster(FLAGS.strategy, workers)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    check_paths()
    check_cluster()
  except errors.ConfigError as e:
    print(f"tfdp-train: error: {e}", file=sys.stderr)
    return 2
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp.app import trainer  # pylint: disable=g-import-not-at-top
  # TF logs one INFO line per variable and collective; keep the console readable.
  tf.get_logger().setLevel("WARNING")
  from tfdp.liveness import preemption  # pylint: disable=g-import-not-at-top
  try:
    trainer.run(config_from_flags())
  except preemption.Preempted as e:
    logging.warning("tfdp-train: %s; exiting with code %d.", e,
                    preemption.EXIT_PREEMPTED)
    return preemption.EXIT_PREEMPTED
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.AbortedError, tf.errors.CancelledError) as e:
    from tfdp.liveness import heartbeat  # pylint: disable=g-import-not-at-top
    from tfdp.liveness import stall  # pylint: disable=g-import-not-at-top
    stall.exit_if_stalled(e, None)  # Exits at once with a line naming the collective.
    if not heartbeat.is_peer_loss(e):
      raise
    heartbeat.exit_peer_lost(e)  # Exits at once with a line naming the peer.
  except errors.TfdpError as e:
    print(f"tfdp-train: error: {e}", file=sys.stderr)
    return 2
  return 0


def _parse_flags(argv):
  """absl's flag parsing, with an unknown or bad flag as one line and exit 2."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"tfdp-train: error: {e} (see tfdp-train --helpshort)", file=sys.stderr)
    sys.exit(2)


def run():
  """Console entry point of `tfdp-train`."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
