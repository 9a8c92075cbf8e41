"""One training run from a config: strategy, model, data, restore, fit, evaluation, checkpoints, summary."""

import dataclasses
import os
import time

from absl import logging
import keras
import tensorflow as tf

import models
from tfdp import callbacks as tfdp_callbacks
from tfdp.distribute import cluster
from tfdp import data
from tfdp import datasets as datasets_lib
from tfdp import errors
from tfdp.resume import train_state as state_lib
from tfdp.app import export
from tfdp.liveness import heartbeat
from tfdp.gradients import settings as gradients_lib
from tfdp.app import optim
from tfdp.liveness import preemption
from tfdp.resume import position as resume_lib
from tfdp.distribute import strategy as strategy_lib
from tfdp.app import summaries
from tfdp.callbacks import fit as training
from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.schedule import policy
from tfdp.checkpoint.persistent import retention


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
  gradient_compression: str | None = None
  bucket_cap_mb: float = gradients_lib.DEFAULT_BUCKET_CAP_MB
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
  local_checkpoint_every_steps: int | str | None = None
  checkpoint_overhead: float = 0.02
  local_checkpoint_dir: str | None = None
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
  eval_every_steps: int | None = None
  eval_steps: int | None = None
  eval_split: str | None = None
  keep_best: str | None = None
  summary_every_steps: int | None = None

  def keep_best_spec(self) -> tuple | None:
    """`keep_best` as (metric, mode, k), or None; raises ConfigError if malformed."""
    if not self.keep_best:
      return None
    try:
      return tuple(retention.parse_keep_best(self.keep_best))
    except errors.ConfigError as e:
      raise errors.ConfigError(f"--{e}") from None

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
    try:
      self.local_checkpoint_every_steps = policy.every_steps(self.local_checkpoint_every_steps)
    except errors.ConfigError as e:
      raise errors.ConfigError(f"--{e}") from None
    if (self.local_checkpoint_every_steps or self.local_checkpoint_dir) and not self.model_dir:
      raise errors.ConfigError(
          "--local_checkpoint_every_steps and --local_checkpoint_dir need --model_dir "
          "(the persistent tier the local one sits in front of).")
    if self.local_checkpoint_dir and not self.local_checkpoint_every_steps:
      raise errors.ConfigError(
          "--local_checkpoint_dir takes effect with --local_checkpoint_every_steps; set it "
          "(e.g. --local_checkpoint_every_steps=10).")
    for name in ("eval_every_steps", "summary_every_steps"):
      if getattr(self, name) is not None and getattr(self, name) < 0:
        raise errors.ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}.")
    if self.eval_steps is not None and self.eval_steps < 1:
      raise errors.ConfigError(f"--eval_steps must be >= 1, got {self.eval_steps}.")
    if not self.eval_every_steps and (self.eval_steps or self.eval_split):
      raise errors.ConfigError(
          "--eval_steps and --eval_split take effect with --eval_every_steps; set it "
          "(e.g. --eval_every_steps=1000).")
    best = self.keep_best_spec()
    if best is not None:
      if not self.model_dir:
        raise errors.ConfigError("--keep_best needs --model_dir (it selects checkpoints).")
      if best[0].startswith("val_") and not self.eval_every_steps:
        raise errors.ConfigError(
            f"--keep_best={self.keep_best} ranks checkpoints by an evaluation metric; "
            "set --eval_every_steps.")
      if (best[0].startswith("val_") and self.checkpoint_every_steps
          and self.checkpoint_every_steps % self.eval_every_steps):
        raise errors.ConfigError(
            f"--keep_best={self.keep_best}: --checkpoint_every_steps="
            f"{self.checkpoint_every_steps} must be a multiple of --eval_every_steps="
            f"{self.eval_every_steps}, so that every checkpoint carries the evaluation "
            "of its own step.")
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
  """What a run leaves behind.

  Attributes:
    model: the trained model.
    start_step: the step the run started at (restored or 0).
    step: the step it ended at.
    checkpoint: the final checkpoint (None without a model_dir).
    histories: the History of each `model.fit` call.
    summary: the end-of-run summary (None when the run was already complete).
    model_path: the `.keras` file written at the end (None without a model_dir).
    already_complete: the restored checkpoint was at or past train_steps.
  """
  model: object
  start_step: int
  step: int
  checkpoint: str | None
  histories: list
  summary: summaries.RunSummary | None = None
  model_path: str | None = None
  already_complete: bool = False


def _source(config, spec, num_workers=1, split="train"):
  return datasets_lib.load(
      config.dataset, task=spec.task, seed=config.seed, num_examples=config.num_examples,
      image_size=config.image_size or spec.image_size, data_dir=config.data_dir,
      vocab_file=config.vocab_file, seq_len=config.seq_len, num_workers=num_workers,
      split=split)


def _chief_says(chief, lines):
  """The chief prints `lines` on stdout, once (the other workers say nothing)."""
  if chief:
    print("\n".join(lines), flush=True)


def _model_kwargs(config, spec, source):
  """What the builder of `spec` is given besides the seed: the data's shapes and model flags."""
  return dict(source.model_kwargs, **{k: getattr(config, k) for k in spec.options})


def _policy(config):
  """The mixed-precision policy of the run, or None."""
  if not config.mixed_precision:
    return None
  # Float16 on GPUs; bfloat16 elsewhere (CPUs lack fast float16). Variables
  # stay float32 either way, which MultiWorkerMirroredStrategy needs (its
  # broadcast has no bfloat16 kernel).
  return "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"


def _build(config, spec, source):
  """The model of `spec` shaped for `source`, under the mixed-precision policy if asked."""
  kwargs = _model_kwargs(config, spec, source)
  policy = _policy(config)
  if policy is None:
    return spec.build(seed=config.seed, **kwargs)
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
  at the same step and raise `tfdp.liveness.preemption.Preempted` (see
  tfdp/preemption.py for the exit codes and the grace period).

  Returns:
    A TrainResult.
  """
  wall_start = time.perf_counter()
  config.validate()
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  gradients_lib.configure_gradients(bucket_cap_mb=config.bucket_cap_mb)
  strategy = strategy_lib.make_strategy(
      config.strategy, cpu_replicas=config.cpu_replicas,
      all_reduce=config.all_reduce, timeout_seconds=config.collective_timeout,
      bytes_per_pack=config.bytes_per_pack,
      gradient_compression=config.gradient_compression or "none")
  worker = cluster.resolve(strategy)
  chief, num_workers = worker.is_chief, worker.count
  if not chief:
    logging.set_verbosity(logging.WARNING)
  data.per_replica_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)

  spec = models.get(config.model)
  eval_split = None
  if config.eval_every_steps:
    eval_split = datasets_lib.eval_split(config.dataset, config.eval_split,
                                         data_dir=config.data_dir)
  source = _source(config, spec, num_workers,
                   datasets_lib.training_split(config.dataset, eval_split))
  eval_source = eval_steps = None
  if eval_split is not None:
    eval_source = _source(config, spec, num_workers, eval_split)
    one_pass = data.steps_per_epoch(eval_source.num_examples, config.global_batch_size)
    eval_steps = config.eval_steps or one_pass
    if eval_steps > one_pass:
      raise errors.ConfigError(
          f"--eval_steps={eval_steps} is more than one pass over split {eval_split!r} "
          f"({eval_source.num_examples} examples, {one_pass} batches of "
          f"{config.global_batch_size}); pass --eval_steps <= {one_pass}.")
  steps_per_epoch = config.steps_per_epoch or data.steps_per_epoch(
      source.num_examples, config.global_batch_size)
  run_config = {
      "model": config.model, "dataset": source.name, "seed": config.seed,
      "global_batch_size": config.global_batch_size,
      "world_size": num_workers, "replicas": strategy.num_replicas_in_sync,
  }
  # What `tfdp-ckpt export --format=keras` rebuilds the model from.
  run_config.update(export.model_run_config(
      config.model, _model_kwargs(config, spec, source), seed=config.seed,
      dtype_policy=_policy(config)))
  with strategy.scope():
    model = _build(config, spec, source)
    _compile(model, config, spec)

  # The same resume path as a user's script: tfdp.callbacks.BackupAndRestore
  # restores, saves every N steps, on preemption and at the end.
  backup, resumed = None, resume_lib.Resume()
  if config.model_dir:
    backup = tfdp_callbacks.BackupAndRestore(
        config.model_dir, save_freq=config.checkpoint_every_steps or False,
        delete_checkpoint=False, save_before_preemption=True,
        preemption_grace_seconds=config.preemption_grace_seconds,
        run_config=run_config, allow_config_mismatch=config.allow_config_mismatch,
        async_save=config.async_checkpoint, max_to_keep=config.max_to_keep,
        max_shard_bytes=config.max_shard_bytes, save_at_end=True,
        local_checkpoint_dir=config.local_checkpoint_dir,
        local_checkpoint_every_steps=config.local_checkpoint_every_steps,
        checkpoint_overhead=config.checkpoint_overhead,
        keep_best=config.keep_best_spec())
    resumed = backup.restore(model, announce=False)
  start_step = resumed.step
  if resumed.restored and start_step >= config.train_steps:
    path = backup.manager.latest_checkpoint
    backup.manager.close()
    _chief_says(chief, [f"tfdp-train: already complete at step {start_step}: {path}"
                        + ("" if start_step == config.train_steps else
                           f" (past --train_steps={config.train_steps})")])
    return TrainResult(model, start_step, start_step, path, [], already_complete=True)
  if backup:
    backup.announce()

  timings = summaries.Timings()
  cbs = []
  evaluator = None
  if eval_source is not None:
    evaluator = summaries.Evaluate(
        lambda: eval_source.distribute(strategy, global_batch_size=config.global_batch_size,
                                       seed=config.seed),
        steps=eval_steps, every_n_steps=config.eval_every_steps,
        train_steps=config.train_steps, timings=timings, split=eval_split)
    # Before the checkpoint callback: a save at an evaluated step carries
    # that evaluation's metrics (for --keep_best).
    cbs.append(evaluator)
  timer = None
  if backup is not None:
    if evaluator is not None:
      evaluator.on_metrics.append(lambda step, metrics: backup.note_metrics(metrics))
    timer = summaries.CheckpointTimer(backup, timings)
    cbs.extend(timer.bracket())
  cbs.append(heartbeat.Heartbeat())  # progress for tfdp-launch --hang_timeout
  board = None
  if chief:
    cbs.append(tfdp_callbacks.Throughput(config.global_batch_size))
    if config.model_dir:
      # Chief only: each writer is an event file of its own, and two files of
      # the same steps overlap in TensorBoard.
      board = summaries.TensorBoard(
          layout_lib.Layout(config.model_dir).logs_dir, global_batch_size=config.global_batch_size,
          update_freq=config.summary_every_steps or max(1, steps_per_epoch // 4),
          timings=timings)
      if evaluator is not None:
        evaluator.on_metrics.append(board.write_eval)
      cbs.append(board)

  def make_dataset(first_step):
    return source.distribute(strategy, global_batch_size=config.global_batch_size,
                             seed=config.seed, start_step=first_step)

  fit_start = time.perf_counter()
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
  finally:
    if board is not None:
      board.flush()
  step = state_lib.global_step(model)
  if timer is not None:
    timer.after_fit(step)
  train_seconds = time.perf_counter() - fit_start
  if board is not None:
    board.write_saves()
    board.close()

  path = model_path = None
  if backup is not None:
    path = backup.manager.latest_checkpoint
    backup.manager.close()
    if chief:
      logging.info("Final checkpoint at step %d: %s", step, path)
    model_path = export.save_keras(
        model, layout_lib.Layout(config.model_dir).keras_path, strategy=strategy)
  last = histories[-1].history if histories else {}
  summary = summaries.RunSummary(
      start_step=start_step, step=step, wall_seconds=time.perf_counter() - wall_start,
      train_seconds=train_seconds, global_batch_size=config.global_batch_size,
      timings=timings, train_metrics={k: v[-1] for k, v in last.items() if v},
      eval=(evaluator.last + (eval_split,)) if evaluator is not None and evaluator.last
      else None, checkpoint=path, model_path=model_path)
  _chief_says(chief, summary.lines())
  return TrainResult(model, start_step, step, path, histories, summary, model_path)
