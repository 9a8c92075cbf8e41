"""What the environment (TF_CONFIG, SLURM) says about the job."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from tfdp import errors

CLUSTERS = ("auto", "tf_config", "slurm")
# Training tasks; an `evaluator` is in the cluster but takes no part in training.
TASK_TYPES = ("worker", "chief")
# First port of the SLURM workers on each node (TFDP_PORT overrides it).
DEFAULT_SLURM_PORT = 8888


def parse_tf_config(raw: str | None = None) -> dict | None:
  """Parses and checks a TF_CONFIG string.

  Args:
    raw: the TF_CONFIG JSON; None reads the environment variable.

  Returns:
    The parsed dict, or None when TF_CONFIG is unset or empty.

  Raises:
    ConfigError: the JSON is malformed or inconsistent (unknown task type,
      index out of range, addresses that are not `host:port`, duplicates).
  """
  if raw is None:
    raw = os.environ.get("TF_CONFIG", "")
  if not raw.strip():
    return None
  fix = ("Set TF_CONFIG to JSON like "
         '{"cluster": {"worker": ["host1:port", "host2:port"]}, '
         '"task": {"type": "worker", "index": 0}}, or unset it for one host.')
  try:
    config = json.loads(raw)
  except json.JSONDecodeError as e:
    raise errors.ConfigError(f"TF_CONFIG is not valid JSON ({e}). {fix}") from e
  if not isinstance(config, dict):
    raise errors.ConfigError(f"TF_CONFIG must be a JSON object. {fix}")
  cluster = config.get("cluster")
  if not isinstance(cluster, dict) or not cluster:
    raise errors.ConfigError(f"TF_CONFIG has no `cluster` object. {fix}")
  seen = set()
  for job, addresses in cluster.items():
    if job not in TASK_TYPES + ("ps", "evaluator"):
      raise errors.ConfigError(
          f"TF_CONFIG cluster has an unknown job {job!r}; tfdp runs "
          f"data-parallel jobs of `worker` (and optionally one `chief`). {fix}")
    if job in ("ps",):
      raise errors.ConfigError(
          "TF_CONFIG names parameter servers (`ps`); tfdp runs synchronous "
          "all-reduce data parallelism, which has no parameter servers. "
          "Remove the `ps` job.")
    if not isinstance(addresses, list) or not addresses:
      raise errors.ConfigError(
          f"TF_CONFIG cluster job {job!r} must be a non-empty list of "
          f"'host:port' strings. {fix}")
    for address in addresses:
      host, _, port = str(address).rpartition(":")
      if not host or not port.isdigit():
        raise errors.ConfigError(
            f"TF_CONFIG address {address!r} of job {job!r} is not 'host:port'.")
      if address in seen:
        raise errors.ConfigError(
            f"TF_CONFIG lists address {address!r} twice; every task needs its "
            "own port.")
      seen.add(address)
  if len(cluster.get("chief", [])) > 1:
    raise errors.ConfigError("TF_CONFIG may name at most one `chief`.")
  task = config.get("task")
  if not isinstance(task, dict):
    raise errors.ConfigError(f"TF_CONFIG has no `task` object. {fix}")
  task_type, index = task.get("type"), task.get("index")
  if task_type not in cluster:
    raise errors.ConfigError(
        f"TF_CONFIG task type {task_type!r} is not a job of the cluster "
        f"({sorted(cluster)}).")
  if not isinstance(index, int) or isinstance(index, bool):
    raise errors.ConfigError(
        f"TF_CONFIG task index must be an integer, got {index!r}.")
  if not 0 <= index < len(cluster[task_type]):
    raise errors.ConfigError(
        f"TF_CONFIG task index {index} is out of range: job {task_type!r} has "
        f"{len(cluster[task_type])} task(s), so the index must be in "
        f"[0, {len(cluster[task_type]) - 1}].")
  return config


def tf_config_or_empty() -> dict:
  """The environment's TF_CONFIG as a dict, unchecked; {} when unset or unreadable.

  For error paths (naming a lost peer), which must not raise themselves.
  """
  try:
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  except ValueError:
    return {}
  return config if isinstance(config, dict) else {}


def own_task(config: dict | None) -> tuple[str | None, int | None]:
  """(task type, index) of this process in a TF_CONFIG-like dict."""
  task = (config or {}).get("task") or {}
  return task.get("type"), task.get("index")


def chief_task(config: dict | None) -> tuple[str, int]:
  """The chief's (task type, index): the `chief` task if any, else worker 0.

  It is also the leader of TensorFlow's coordination service.
  """
  cluster = (config or {}).get("cluster") or {}
  return ("chief" if cluster.get("chief") else "worker"), 0


def num_cluster_workers(config: dict | None) -> int:
  """Number of training tasks (chief + workers) in a parsed TF_CONFIG."""
  if not config:
    return 1
  cluster = config["cluster"]
  return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def worker_index(task_type: str, task_id: int, cluster: dict) -> int:
  """tfdp's worker index of a task: the chief is 0, `worker:i` is i+1 when a chief exists."""
  if task_type == "chief":
    return 0
  return int(task_id) + (1 if cluster.get("chief") else 0)


def in_slurm_step() -> bool:
  """Whether this process is a task of a SLURM job step (started by `srun`)."""
  return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def slurm_resolver(port_base: int | None = None):
  """A `SlurmClusterResolver` for this SLURM job step: one worker per task.

  Run one task per node (`srun --ntasks-per-node=1`); the task uses every
  GPU of its node. Worker i listens on `port_base + (its rank on the node)`.

  Args:
    port_base: first port on each node (default $TFDP_PORT or 8888).

  Returns:
    A `tf.distribute.cluster_resolver.SlurmClusterResolver`.

  Raises:
    ConfigError: not inside a SLURM job step, or SLURM's variables are
      inconsistent.
  """
  if not in_slurm_step():
    raise errors.ConfigError(
        "cluster='slurm' needs a SLURM job step (SLURM_PROCID and "
        "SLURM_STEP_NUM_TASKS are unset): start the workers with `srun`.")
  if port_base is None:
    port_base = int(os.environ.get("TFDP_PORT", DEFAULT_SLURM_PORT))
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver
  # pylint: enable=g-import-not-at-top
  try:
    gpus = len(tf.config.list_physical_devices("GPU"))
    if not gpus:
      # The resolver hands out GPUs per task and lists one task per GPU; on
      # CPU hosts give it one placeholder per task (auto_set_gpu is off, so
      # no CUDA_VISIBLE_DEVICES is set from them).
      tasks = max(slurm_cluster_resolver.expand_tasks_per_node(
          os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1")))
      return tf.distribute.cluster_resolver.SlurmClusterResolver(
          port_base=port_base, gpus_per_node=tasks, gpus_per_task=1,
          auto_set_gpu=False)
    return tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=port_base, gpus_per_node=gpus, auto_set_gpu=False)
  except (RuntimeError, ValueError) as e:
    raise errors.ConfigError(f"Cannot resolve the SLURM cluster: {e}") from e


def resolve_cluster(cluster: str = "auto") -> tuple[Any, dict | None]:
  """Finds the cluster this process belongs to.

  Args:
    cluster: `tf_config` (the TF_CONFIG variable), `slurm` (SLURM's job step
      variables, through `SlurmClusterResolver`), or `auto`: TF_CONFIG when
      set, else SLURM when inside a step of 2+ tasks, else no cluster.

  Returns:
    (resolver, config): `resolver` is a cluster resolver for the strategy,
    or None to let TF read TF_CONFIG; `config` is a TF_CONFIG-like dict
    `{"cluster": ..., "task": ...}`, or None for one host.

  Raises:
    ConfigError: unknown `cluster`, a bad TF_CONFIG, or no SLURM step.
  """
  if cluster not in CLUSTERS:
    raise errors.ConfigError(
        f"Unknown cluster {cluster!r}; choose one of {', '.join(CLUSTERS)}.")
  config = parse_tf_config() if cluster in ("auto", "tf_config") else None
  if cluster == "tf_config" or config is not None:
    return None, config
  if cluster == "auto" and (not in_slurm_step() or
                            int(os.environ["SLURM_STEP_NUM_TASKS"]) < 2):
    return None, None
  resolver = slurm_resolver()
  spec = resolver.cluster_spec().as_dict()
  task_type, task_id = resolver.get_task_info()
  return resolver, {"cluster": spec, "task": {"type": task_type, "index": task_id}}


@dataclasses.dataclass(frozen=True)
class Described:
  """What the environment says about this process.

  Attributes:
    count: number of training tasks the environment names (1 when none).
    index: this process's worker index (see `worker_index`).
    task: (TF task type, task id), when the environment names one.
    address: this task's `host:port`, when TF_CONFIG gives it.
    where: who says so, for messages: "TF_CONFIG", "the SLURM job step", or "".
  """

  count: int
  index: int
  task: tuple[str, int] | None
  address: str | None
  where: str


def described() -> Described:
  """The job TF_CONFIG (first) or a SLURM job step describes; one worker when neither is set.

  Raises:
    ConfigError: a bad TF_CONFIG.
  """
  config = parse_tf_config()
  if config is not None:
    task_type, task_id = own_task(config)
    cluster = config["cluster"]
    return Described(num_cluster_workers(config),
                     worker_index(task_type, task_id, cluster), (task_type, task_id),
                     cluster[task_type][task_id], "TF_CONFIG")
  if in_slurm_step():
    index = int(os.environ["SLURM_PROCID"])
    return Described(int(os.environ["SLURM_STEP_NUM_TASKS"]), index,
                     ("worker", index), None, "the SLURM job step")
  return Described(1, 0, None, None, "")
