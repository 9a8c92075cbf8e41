"""Strategy factory: cluster resolution (TF_CONFIG, SLURM), all-reduce choice, logical CPU replicas."""

import json
import os

from absl import logging
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import distribute_lib

from tfdp import errors

KINDS = ("auto", "mirrored", "multi_worker", "one_device", "default")
ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduce_to_one", "ring")
CLUSTERS = ("auto", "tf_config", "slurm")
_TASK_TYPES = ("worker", "chief")

# A worker that misses heartbeats to TensorFlow's coordination service for
# this long counts as lost: every other worker's collectives are aborted with
# an error naming it (see tfdp.heartbeat.exit_peer_lost for the exit). TF's
# own default is the same; tfdp sets it explicitly so the bound it documents
# does not move with TF releases.
DEFAULT_PEER_TIMEOUT_SECONDS = 10.0

# Gradient pack size of ring (gRPC) collective all-reduce when none is given.
# scripts/bench_train.py --parts=allreduce, 2 workers on localhost, 2026-11-29
# (README, Performance): 4 MB packs were 1.2-1.8x faster than one pack for
# 64-256 MB of gradients in 3 of 5 runs, equal in the other 2, never slower;
# one pack concatenates everything and cannot pipeline reduction and transfer.
# NCCL keeps TF's single pack (0): it is most efficient with large messages,
# and no GPU measurement says otherwise yet.
DEFAULT_RING_BYTES_PER_PACK = 4 << 20

# First port of the SLURM workers on each node (TFDP_PORT overrides it).
DEFAULT_SLURM_PORT = 8888


def parse_tf_config(raw=None):
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
    if job not in _TASK_TYPES + ("ps", "evaluator"):
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


def _in_slurm_step():
  return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def slurm_resolver(port_base=None):
  """A `SlurmClusterResolver` for this SLURM job step: one worker per task.

  Run one task per node (`srun --ntasks-per-node=1`); the task uses every
  GPU of its node. Worker i listens on `port_base + (its rank on the node)`.

  Args:
    port_base: first port on each node (default $TFDP_PORT or 8888).

  Raises:
    ConfigError: not inside a SLURM job step, or SLURM's variables are
      inconsistent.
  """
  if not _in_slurm_step():
    raise errors.ConfigError(
        "cluster='slurm' needs a SLURM job step (SLURM_PROCID and "
        "SLURM_STEP_NUM_TASKS are unset): start the workers with `srun`.")
  if port_base is None:
    port_base = int(os.environ.get("TFDP_PORT", DEFAULT_SLURM_PORT))
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver
  # pylint: enable=g-import-not-at-top
  try:
    gpus = len(_gpus())
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


def resolve_cluster(cluster="auto"):
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
  if cluster == "auto" and (not _in_slurm_step() or
                            int(os.environ["SLURM_STEP_NUM_TASKS"]) < 2):
    return None, None
  resolver = slurm_resolver()
  spec = resolver.cluster_spec().as_dict()
  task_type, task_id = resolver.get_task_info()
  return resolver, {"cluster": spec, "task": {"type": task_type, "index": task_id}}


def _configure_peer_timeout(config, peer_timeout_seconds):
  """Configures TF's coordination service as MultiWorkerMirroredStrategy would, with our heartbeat timeout."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
  from tensorflow.python.distribute import multi_worker_util
  from tensorflow.python.eager import context
  # pylint: enable=g-import-not-at-top
  if context.context().coordination_service is not None:
    return
  spec = tf.train.ClusterSpec(config["cluster"])
  if config["task"]["type"] not in _TASK_TYPES:
    return
  jobs = [coordination_config_pb2.CoordinatedJob(name=j, num_tasks=spec.num_tasks(j))
          for j in ("chief", "worker") if j in spec.jobs]
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(spec),
      coordinated_jobs=jobs,
      heartbeat_timeout_in_ms=int(peer_timeout_seconds * 1000))


def num_cluster_workers(config):
  """Number of training tasks (chief + workers) in a parsed TF_CONFIG."""
  if not config:
    return 1
  cluster = config["cluster"]
  return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def configure_cpu_replicas(n):
  """Splits the host CPU into `n` logical devices (before TF initialises them).

  Raises:
    ConfigError: `n` < 1, or TF already initialised its devices with another
      split (call `make_strategy` before any other TensorFlow work).
  """
  if n is None:
    return
  if not isinstance(n, int) or n < 1:
    raise errors.ConfigError(f"cpu_replicas must be a positive integer, got {n!r}.")
  cpu = tf.config.list_physical_devices("CPU")[0]
  current = tf.config.get_logical_device_configuration(cpu)
  if current is not None and len(current) == n:
    return
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
  except RuntimeError as e:
    have = len(tf.config.list_logical_devices("CPU"))
    raise errors.ConfigError(
        f"cpu_replicas={n} cannot be applied: TensorFlow has already "
        f"initialised its devices ({have} logical CPU device(s)). Call "
        "tfdp.make_strategy(...) at the start of the program, before creating "
        "any tensor, model or dataset.") from e


def communication_options(implementation="auto", *, timeout_seconds=None,
                          bytes_per_pack=0):
  """`tf.distribute.experimental.CommunicationOptions` for collective all-reduce."""
  impls = tf.distribute.experimental.CommunicationImplementation
  mapping = {"auto": impls.AUTO, "ring": impls.RING, "nccl": impls.NCCL}
  if implementation not in mapping:
    raise errors.ConfigError(
        f"all_reduce={implementation!r} is not available across workers; use "
        "one of auto, ring, nccl (hierarchical_copy and reduce_to_one are "
        "single-host MirroredStrategy methods).")
  if bytes_per_pack is None or bytes_per_pack < 0:
    raise errors.ConfigError(f"bytes_per_pack must be >= 0, got {bytes_per_pack!r}.")
  if timeout_seconds is not None and timeout_seconds <= 0:
    raise errors.ConfigError(
        f"timeout_seconds must be positive or None, got {timeout_seconds!r}.")
  return tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds,
      implementation=mapping[implementation])


class _CpuReplicasExtended(collective_all_reduce_strategy.CollectiveAllReduceExtended):
  """Multi-worker extended that mirrors over every logical CPU of a worker.

  Upstream (`CollectiveAllReduceExtended._initialize_local_devices`) uses one
  CPU device per worker when there is no GPU, so `cpu_replicas` would be
  ignored under multi-worker. With no GPU, this uses CPU:0..N-1 instead.
  """

  def __init__(self, container_strategy, cluster_resolver, communication_options,
               cpu_replicas):
    self._tfdp_cpu_replicas = cpu_replicas
    super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                     communication_options=communication_options)

  def _initialize_local_devices(self, cluster_resolver, worker_device):
    devices, device_type = super()._initialize_local_devices(
        cluster_resolver, worker_device)
    if device_type != "CPU":
      return devices, device_type
    return tuple(f"{worker_device}/device:CPU:{i}"
                 for i in range(self._tfdp_cpu_replicas)), "CPU"


class _MultiWorkerCpuReplicasStrategy(tf.distribute.MultiWorkerMirroredStrategy):
  """`MultiWorkerMirroredStrategy` with `cpu_replicas` replicas per worker."""

  def __init__(self, cpu_replicas, communication_options, cluster_resolver=None):
    # Skips MultiWorkerMirroredStrategy.__init__ only to inject the extended;
    # the rest of that constructor is usage metrics.
    distribute_lib.Strategy.__init__(  # pylint: disable=non-parent-init-called
        self, _CpuReplicasExtended(
            self, cluster_resolver=cluster_resolver,
            communication_options=communication_options,
            cpu_replicas=cpu_replicas))


def _gpus():
  return tf.config.list_physical_devices("GPU")


# Collective group keys of single-host ring all-reduce, unique per strategy in
# this process: TF caches collective instances by (group, instance) key, so two
# strategies starting from the same key clash ("Shape mismatch in the collective
# instance"). Across workers keys must agree, which MWMS arranges itself.
_next_group_key = [10_000]


def _mirrored_cross_device_ops(all_reduce, devices, options):
  if all_reduce == "nccl":
    return tf.distribute.NcclAllReduce()
  if all_reduce == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce()
  if all_reduce == "reduce_to_one":
    return tf.distribute.ReductionToOneDevice()
  if all_reduce == "ring":
    from tensorflow.python.distribute import cross_device_ops  # pylint: disable=g-import-not-at-top
    from tensorflow.python.distribute import cross_device_utils  # pylint: disable=g-import-not-at-top
    _next_group_key[0] += 1000
    return cross_device_ops.CollectiveAllReduce(
        devices=devices, group_size=len(devices), options=options,
        collective_keys=cross_device_utils.CollectiveKeys(
            group_key_start=_next_group_key[0]))
  # auto: NCCL between GPUs, a reduction on one device between CPU replicas.
  if devices and all("GPU" in d for d in devices):
    return tf.distribute.NcclAllReduce()
  return tf.distribute.ReductionToOneDevice()


def default_bytes_per_pack(all_reduce, have_gpus):
  """The pack size `make_strategy` uses when given none: 4 MB for ring, 0 for NCCL."""
  ring = all_reduce == "ring" or not have_gpus
  return DEFAULT_RING_BYTES_PER_PACK if ring else 0


def make_strategy(kind="auto", *, cpu_replicas=None, all_reduce="auto",
                  timeout_seconds=None, bytes_per_pack=None, cluster="auto",
                  peer_timeout_seconds=DEFAULT_PEER_TIMEOUT_SECONDS):
  """Creates the `tf.distribute.Strategy` for this process.

  Call it first, before any other TensorFlow work: logical CPU devices and
  multi-worker collectives can only be configured before TF initialises.

  Args:
    kind: `auto` (TF_CONFIG with 2+ workers -> multi_worker; else 2+ GPUs or
      cpu_replicas > 1 -> mirrored; 1 GPU -> one_device; else default),
      `mirrored`, `multi_worker`, `one_device` or `default`.
    cpu_replicas: split the host CPU into this many logical devices and
      mirror over them (replicas per worker under multi_worker). Ignored where
      GPUs are used.
    all_reduce: `auto`, `nccl`, `hierarchical_copy`, `reduce_to_one` or
      `ring`.
    timeout_seconds: collective timeout (multi_worker and ring), None = none.
    bytes_per_pack: split gradients into packs of this size for collective
      all-reduce; 0: one pack; None: 4 MB for ring (gRPC) collectives, one
      pack for NCCL (`default_bytes_per_pack`).
    cluster: where the cluster comes from: `auto`, `tf_config` or `slurm`
      (see `resolve_cluster`).
    peer_timeout_seconds: multi_worker: a peer that sends no heartbeat to
      the coordination service for this long is lost, and the collectives
      of every other worker fail with an error naming it.

  Returns:
    A `tf.distribute.Strategy`.

  Raises:
    ConfigError: unknown kind, cluster or all-reduce, NCCL without GPUs, bad
      TF_CONFIG or SLURM step, cpu_replicas too late or invalid.
  """
  if kind not in KINDS:
    raise errors.ConfigError(f"Unknown strategy {kind!r}; choose one of {', '.join(KINDS)}.")
  if all_reduce not in ALL_REDUCE:
    raise errors.ConfigError(
        f"Unknown all_reduce {all_reduce!r}; choose one of {', '.join(ALL_REDUCE)}.")
  gpus = _gpus()
  if all_reduce == "nccl" and not gpus:
    raise errors.ConfigError(
        "all_reduce='nccl' needs GPUs and none is visible; use all_reduce="
        "'ring' (across workers) or 'reduce_to_one' (between CPU replicas), or "
        "'auto'.")
  resolver, config = resolve_cluster(cluster)
  workers = num_cluster_workers(config)
  if kind == "auto":
    if workers > 1:
      kind = "multi_worker"
    elif len(gpus) > 1 or (not gpus and (cpu_replicas or 1) > 1):
      kind = "mirrored"
    elif len(gpus) == 1:
      kind = "one_device"
    else:
      kind = "default"
  if kind == "multi_worker" and config is None:
    raise errors.ConfigError(
        "strategy 'multi_worker' needs TF_CONFIG describing the cluster; start "
        "the workers with `tfdp-launch --num_workers=N -- COMMAND`, set "
        "TF_CONFIG on each host, or run them as a SLURM job step (`srun`).")
  if kind != "multi_worker" and workers > 1:
    raise errors.ConfigError(
        f"TF_CONFIG describes {workers} workers but strategy {kind!r} trains on "
        "one host; use --strategy=multi_worker (or auto), or unset TF_CONFIG.")
  if bytes_per_pack is None:
    bytes_per_pack = default_bytes_per_pack(all_reduce, bool(gpus))
  if not gpus:
    configure_cpu_replicas(cpu_replicas)
  elif cpu_replicas:
    logging.warning("cpu_replicas=%d ignored: %d GPU(s) are used.", cpu_replicas,
                    len(gpus))

  if kind == "multi_worker":
    options = communication_options(
        "auto" if all_reduce == "auto" else all_reduce,
        timeout_seconds=timeout_seconds, bytes_per_pack=bytes_per_pack)
    if peer_timeout_seconds is not None and peer_timeout_seconds <= 0:
      raise errors.ConfigError(
          f"peer_timeout_seconds must be positive, got {peer_timeout_seconds!r}.")
    if peer_timeout_seconds:
      _configure_peer_timeout(config, peer_timeout_seconds)
    if not gpus and (cpu_replicas or 1) > 1:
      strategy = _MultiWorkerCpuReplicasStrategy(cpu_replicas, options, resolver)
    else:
      strategy = tf.distribute.MultiWorkerMirroredStrategy(
          cluster_resolver=resolver, communication_options=options)
  elif kind == "mirrored":
    devices = ([f"/gpu:{i}" for i in range(len(gpus))] if gpus else
               [d.name for d in tf.config.list_logical_devices("CPU")])
    if all_reduce in ("nccl",) and not gpus:
      raise errors.ConfigError("all_reduce='nccl' needs GPUs.")
    options = communication_options(
        "ring" if all_reduce == "ring" else "auto",
        timeout_seconds=timeout_seconds, bytes_per_pack=bytes_per_pack)
    strategy = tf.distribute.MirroredStrategy(
        devices=devices,
        cross_device_ops=_mirrored_cross_device_ops(all_reduce, devices, options))
  elif kind == "one_device":
    strategy = tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
  else:
    strategy = tf.distribute.get_strategy()
  logging.info("tfdp strategy: %s, %d replica(s) in sync, all_reduce=%s",
               type(strategy).__name__, strategy.num_replicas_in_sync, all_reduce)
  return strategy


def worker_info(strategy=None):
  """(worker index, number of workers) of this process under `strategy`.

  The index is the task's id in the cluster (a `chief` is 0, workers follow);
  single-host strategies are worker 0 of 1.
  """
  extended = (strategy or tf.distribute.get_strategy()).extended
  num_workers = getattr(extended, "_num_workers", 1)
  if num_workers <= 1:
    return 0, 1
  return int(extended._id_in_cluster), num_workers  # pylint: disable=protected-access


def is_chief(strategy=None):
  """True on the one worker that writes logs and prints progress."""
  return worker_info(strategy)[0] == 0
