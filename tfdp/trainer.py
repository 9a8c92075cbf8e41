"""One training run from a config: strategy, model, data, restore, fit, checkpoints."""

import dataclasses
import os

from absl import logging
import keras
import tensorflow as tf

import models
from tfdp import callbacks as tfdp_callbacks
from tfdp import cluster
from tfdp import data
from tfdp import datasets as datasets_lib
from tfdp import errors
from tfdp import heartbeat
from tfdp import optim
from tfdp import preemption
from tfdp import strategy as strategy_lib
from tfdp import training


@dataclasses.dataclass
class TrainConfig:
  """Everything `run` needs; `tfdp-train`'s flags map onto it one to one."""
  model: str = "cnn"
  dataset: str = "synthetic"
  strategy: str = "auto"
  cpu_replicas: int | None = None
  all_reduce: str = "auto"
  collective_timeout: float | None = None
  bytes_per_pack: int | None = None
  global_batch_size: int = 32
  train_steps: int = 100
  steps_per_epoch: int | None = None
  learning_rate: float | None = None
  base_learning_rate: float | None = None
  warmup_steps: int = 0
  lr_decay: str = "constant"
  optimizer: str = "auto"
  momentum: float = 0.9
  weight_decay: float | None = None
  label_smoothing: float = 0.0
  mixed_precision: bool = False
  seed: int = 0
  deterministic: bool = False
  model_dir: str | None = None
  checkpoint_every_steps: int | None = None
  async_checkpoint: bool = False
  max_to_keep: int | None = 5
  max_shard_bytes: int | None = None
  allow_config_mismatch: bool = False
  preemption_grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS
  num_examples: int = 2048
  data_dir: str | None = None
  image_size: int | None = None
  bert_config: str = "tiny"
  vocab_file: str | None = None
  seq_len: int = 128

  def validate(self):
    """Raises ConfigError for values no run can use."""
    if self.train_steps < 0:
      raise errors.ConfigError(f"--train_steps must be >= 0, got {self.train_steps}.")
    if self.global_batch_size < 1:
      raise errors.ConfigError(
          f"--global_batch_size must be >= 1, got {self.global_batch_size}.")
    if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
      raise errors.ConfigError(
          f"--steps_per_epoch must be >= 1, got {self.steps_per_epoch}.")
    if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 0:
      raise errors.ConfigError(
          f"--checkpoint_every_steps must be >= 0, got {self.checkpoint_every_steps}.")
    optim.peak_learning_rate(self.global_batch_size, learning_rate=self.learning_rate,
                             base_learning_rate=self.base_learning_rate)
    if not 0 <= self.label_smoothing < 1:
      raise errors.ConfigError(
          f"--label_smoothing must be in [0, 1), got {self.label_smoothing}.")
    try:
      models.get(self.model)
    except KeyError as e:
      raise errors.ConfigError(str(e.args[0])) from None
    datasets_lib.check_name(self.dataset)


@dataclasses.dataclass
class TrainResult:
  """What a run leaves behind."""
  model: object
  start_step: int
  step: int
  checkpoint: str | None
  histories: list


def _source(config, spec, num_workers=1):
  return datasets_lib.load(
      config.dataset, task=spec.task, seed=config.seed, num_examples=config.num_examples,
      image_size=config.image_size or spec.image_size, data_dir=config.data_dir,
      vocab_file=config.vocab_file, seq_len=config.seq_len, num_workers=num_workers)


def _build(config, spec, source):
  """The model of `spec` shaped for `source`, under the mixed-precision policy if asked."""
  kwargs = dict(source.model_kwargs, **{k: getattr(config, k) for k in spec.options})
  if not config.mixed_precision:
    return spec.build(seed=config.seed, **kwargs)
  # Float16 on GPUs; bfloat16 elsewhere (CPUs lack fast float16). Variables
  # stay float32 either way, which MultiWorkerMirroredStrategy needs (its
  # broadcast has no bfloat16 kernel).
  policy = "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"
  previous = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy(policy)
  try:
    return spec.build(seed=config.seed, **kwargs)
  finally:
    keras.mixed_precision.set_global_policy(previous)


def _compile(model, config, spec):
  model.compile(optimizer=optim.from_config(config, spec),
                **spec.compile_args(label_smoothing=config.label_smoothing))


def run(config):
  """Trains as `config` says, resuming from `config.model_dir` if it holds a checkpoint.

  With a model_dir, SIGTERM or SIGINT to any worker makes all workers save
  at the same step and raise `tfdp.preemption.Preempted` (see
  tfdp/preemption.py for the exit codes and the grace period).

  Returns:
    A TrainResult.
  """
  config.validate()
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  strategy = strategy_lib.make_strategy(
      config.strategy, cpu_replicas=config.cpu_replicas,
      all_reduce=config.all_reduce, timeout_seconds=config.collective_timeout,
      bytes_per_pack=config.bytes_per_pack)
  worker = cluster.resolve(strategy)
  chief, num_workers = worker.is_chief, worker.count
  if not chief:
    logging.set_verbosity(logging.WARNING)
  data.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)

  spec = models.get(config.model)
  source = _source(config, spec, num_workers)
  steps_per_epoch = config.steps_per_epoch or data.steps_per_epoch(
      source.num_examples, config.global_batch_size)
  run_config = {
      "model": config.model, "dataset": source.name, "seed": config.seed,
      "global_batch_size": config.global_batch_size,
      "world_size": num_workers, "replicas": strategy.num_replicas_in_sync,
  }
  with strategy.scope():
    model = _build(config, spec, source)
    _compile(model, config, spec)

  # The same resume path as a user's script: tfdp.callbacks.BackupAndRestore
  # restores, saves every N steps, on preemption and at the end.
  backup = None
  cbs = []
  if config.model_dir:
    backup = tfdp_callbacks.BackupAndRestore(
        config.model_dir, save_freq=config.checkpoint_every_steps or False,
        delete_checkpoint=False, save_before_preemption=True,
        preemption_grace_seconds=config.preemption_grace_seconds,
        run_config=run_config, allow_config_mismatch=config.allow_config_mismatch,
        async_save=config.async_checkpoint, max_to_keep=config.max_to_keep,
        max_shard_bytes=config.max_shard_bytes, save_at_end=True)
    backup.restore(model)
    cbs.append(backup)
  start_step = int(model.optimizer.iterations.numpy())
  if start_step > config.train_steps:
    raise errors.ConfigError(
        f"{config.model_dir} holds a checkpoint at step {start_step}, past "
        f"--train_steps={config.train_steps}; raise --train_steps or use a new "
        "--model_dir.")

  cbs.append(heartbeat.Heartbeat())  # progress for tfdp-launch --hang_timeout
  if chief:
    cbs.append(tfdp_callbacks.Throughput(config.global_batch_size))
    if config.model_dir:
      cbs.append(keras.callbacks.TensorBoard(
          os.path.join(config.model_dir, "logs"), update_freq=max(1, steps_per_epoch // 4)))

  def make_dataset(first_step):
    return source.distribute(strategy, global_batch_size=config.global_batch_size,
                             seed=config.seed, start_step=first_step)

  try:
    histories = training.fit(
        model, make_dataset, start_step=start_step, train_steps=config.train_steps,
        steps_per_epoch=steps_per_epoch, callbacks=cbs,
        verbose="auto" if chief else 0)
  except preemption.Preempted as e:
    if chief:
      logging.warning("Preempted: saved %s at step %d; run the same command "
                      "again to resume.", e.checkpoint, e.step)
    raise

  step = int(model.optimizer.iterations.numpy())
  path = None
  if backup is not None:
    path = backup.manager.latest_checkpoint
    backup.manager.close()
    if chief:
      logging.info("Final checkpoint at step %d: %s", step, path)
  return TrainResult(model, start_step, step, path, histories)
