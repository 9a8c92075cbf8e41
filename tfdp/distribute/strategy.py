"""Strategy factory: a pure choice of kind, one builder per kind, the all-reduce choice, logical CPU replicas."""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import distribute_lib

from tfdp.distribute import environment
from tfdp import errors
from tfdp.gradients import settings as gradients
from tfdp.distribute import startup
# The kinds and choose_kind are TensorFlow-free (tfdp-train checks its flags before TF starts).
from tfdp.distribute.kinds import ALL_REDUCE, KINDS, choose_kind  # pylint: disable=unused-import


# A worker that misses heartbeats to TensorFlow's coordination service for
# this long counts as lost: every other worker's collectives are aborted with
# an error naming it (see tfdp.liveness.heartbeat.exit_peer_lost for the exit). TF's
# own default is the same; tfdp sets it explicitly so the bound it documents
# does not move with TF releases.
DEFAULT_PEER_TIMEOUT_SECONDS = 10.0

# Gradient pack size of ring (gRPC) collective all-reduce when none is given:
# several packs let reduction and transfer overlap, one pack cannot (the
# measurements are in docs/performance.md). NCCL keeps TF's
# single pack (0): it is most efficient with large messages.
DEFAULT_RING_BYTES_PER_PACK = 4 << 20


def default_bytes_per_pack(all_reduce: str, have_gpus: bool) -> int:
  """The pack size `make_strategy` uses when given none: 4 MB for ring, 0 for NCCL."""
  ring = all_reduce == "ring" or not have_gpus
  return DEFAULT_RING_BYTES_PER_PACK if ring else 0


# -- Pieces the builders share ------------------------------------------------


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
  if config["task"]["type"] not in environment.TASK_TYPES:
    return
  jobs = [coordination_config_pb2.CoordinatedJob(name=j, num_tasks=spec.num_tasks(j))
          for j in ("chief", "worker") if j in spec.jobs]
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(spec),
      coordinated_jobs=jobs,
      heartbeat_timeout_in_ms=int(peer_timeout_seconds * 1000))


def configure_cpu_replicas(n: int | None) -> None:
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


def communication_options(implementation: str = "auto", *,
                          bytes_per_pack: int = 0
                          ) -> tf.distribute.experimental.CommunicationOptions:
  """`tf.distribute.experimental.CommunicationOptions` for collective all-reduce.

  No TensorFlow timeout: it keeps a timer thread per collective for the
  whole timeout; tfdp.liveness.stall keeps the collective deadline instead.

  Raises:
    ConfigError: a single-host method or a negative pack size.
  """
  impls = tf.distribute.experimental.CommunicationImplementation
  mapping = {"auto": impls.AUTO, "ring": impls.RING, "nccl": impls.NCCL}
  if implementation not in mapping:
    raise errors.ConfigError(
        f"all_reduce={implementation!r} is not available across workers; use "
        "one of auto, ring, nccl (hierarchical_copy and reduce_to_one are "
        "single-host MirroredStrategy methods).")
  if bytes_per_pack is None or bytes_per_pack < 0:
    raise errors.ConfigError(f"bytes_per_pack must be >= 0, got {bytes_per_pack!r}.")
  return tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=bytes_per_pack, implementation=mapping[implementation])


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


def _gpus():
  return tf.config.list_physical_devices("GPU")


@dataclasses.dataclass(frozen=True)
class _Request:
  """What every builder may need: the arguments of `make_strategy`, checked, and the cluster."""

  num_gpus: int
  cpu_replicas: int | None
  all_reduce: str
  bytes_per_pack: int
  peer_timeout_seconds: float | None
  startup_timeout_seconds: float | None
  resolver: Any
  config: dict | None


# -- One builder per kind -----------------------------------------------------


def _check_tf_not_started() -> None:
  """Raises ConfigError when TF has started: multi-worker collectives must be configured first."""
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  if context.context()._initialized:  # pylint: disable=protected-access
    raise errors.ConfigError(
        "tfdp.make_strategy() must run before TensorFlow starts in a multi-worker job "
        "(its collectives are configured at start-up): call it right after the "
        "imports, before building any tf.data dataset, model or tensor.")


def _build_multi_worker(r: _Request) -> tf.distribute.Strategy:
  options = communication_options(
      r.all_reduce, bytes_per_pack=r.bytes_per_pack)
  if r.peer_timeout_seconds is not None and r.peer_timeout_seconds <= 0:
    raise errors.ConfigError(
        f"peer_timeout_seconds must be positive, got {r.peer_timeout_seconds!r}.")
  _check_tf_not_started()
  if r.peer_timeout_seconds:
    _configure_peer_timeout(r.config, r.peer_timeout_seconds)
  # TF would wait for the peers deaf to signals; wait for them in Python first.
  startup.wait_for_peers(r.config, r.startup_timeout_seconds)
  if not r.num_gpus and (r.cpu_replicas or 1) > 1:
    return _MultiWorkerCpuReplicasStrategy(r.cpu_replicas, options, r.resolver)
  return tf.distribute.MultiWorkerMirroredStrategy(
      cluster_resolver=r.resolver, communication_options=options)


def _build_mirrored(r: _Request) -> tf.distribute.Strategy:
  devices = ([f"/gpu:{i}" for i in range(r.num_gpus)] if r.num_gpus else
             [d.name for d in tf.config.list_logical_devices("CPU")])
  options = communication_options(
      "ring" if r.all_reduce == "ring" else "auto",
      bytes_per_pack=r.bytes_per_pack)
  return tf.distribute.MirroredStrategy(
      devices=devices,
      cross_device_ops=_mirrored_cross_device_ops(r.all_reduce, devices, options))


def _build_one_device(r: _Request) -> tf.distribute.Strategy:
  return tf.distribute.OneDeviceStrategy("/gpu:0" if r.num_gpus else "/cpu:0")


def _build_default(r: _Request) -> tf.distribute.Strategy:  # pylint: disable=unused-argument
  return tf.distribute.get_strategy()


_BUILDERS = {
    "multi_worker": _build_multi_worker,
    "mirrored": _build_mirrored,
    "one_device": _build_one_device,
    "default": _build_default,
}


def make_strategy(kind: str = "auto", *, cpu_replicas: int | None = None,
                  all_reduce: str = "auto", timeout_seconds: float | None = None,
                  bytes_per_pack: int | None = None, cluster: str = "auto",
                  peer_timeout_seconds: float | None = DEFAULT_PEER_TIMEOUT_SECONDS,
                  gradient_compression: str | None = None,
                  startup_timeout_seconds: float | None = None
                  ) -> tf.distribute.Strategy:
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
    timeout_seconds: how long one step may wait in its collectives before
      the worker fails with a line naming them (multi-worker; see
      tfdp.liveness.stall); it sets `tfdp.configure_gradients(timeout_seconds=...)`
      (600 s unless set). None keeps that setting.
    bytes_per_pack: split gradients into packs of this size for collective
      all-reduce; 0: one pack; None: 4 MB for ring (gRPC) collectives, one
      pack for NCCL (`default_bytes_per_pack`).
    cluster: where the cluster comes from: `auto`, `tf_config` or `slurm`
      (see `tfdp.distribute.environment.resolve_cluster`).
    peer_timeout_seconds: multi_worker: a peer that sends no heartbeat to
      the coordination service for this long is lost, and the collectives
      of every other worker fail with an error naming it.
    gradient_compression: "bf16" or "fp16" all-reduces the gradients in that
      dtype, "none" in their own; None keeps the gradient path's setting
      (`tfdp.configure_gradients`; off unless set). Any strategy's `fit` takes
      it: see tfdp.gradients.
    startup_timeout_seconds: multi_worker: how long a worker waits for the
      others of TF_CONFIG to connect before it exits with code 2 and a line
      naming them (default: env TFDP_STARTUP_TIMEOUT, else no limit). While
      it waits it names them every 30 s, and SIGINT or SIGTERM end it
      (exit code 2); see tfdp.distribute.startup.

  Returns:
    A `tf.distribute.Strategy`.

  Raises:
    ConfigError: unknown kind, cluster or all-reduce, NCCL without GPUs, bad
      TF_CONFIG or SLURM step, cpu_replicas too late or invalid.
  """
  given = {k: v for k, v in (("compression", gradient_compression),
                             ("timeout_seconds", timeout_seconds)) if v is not None}
  if given:
    gradients.configure_gradients(**given)
  num_gpus = len(_gpus())
  resolver, config = environment.resolve_cluster(cluster)
  workers = None if config is None else environment.num_cluster_workers(config)
  kind = choose_kind(
      kind, tf_config_workers=workers,
      num_gpus=num_gpus, cpu_replicas=cpu_replicas, all_reduce=all_reduce)
  if bytes_per_pack is None:
    bytes_per_pack = default_bytes_per_pack(all_reduce, bool(num_gpus))
  if not num_gpus:
    configure_cpu_replicas(cpu_replicas)
  elif cpu_replicas:
    logging.warning("cpu_replicas=%d ignored: %d GPU(s) are used.", cpu_replicas,
                    num_gpus)
  strategy = _BUILDERS[kind](_Request(
      num_gpus=num_gpus, cpu_replicas=cpu_replicas, all_reduce=all_reduce,
      bytes_per_pack=bytes_per_pack,
      peer_timeout_seconds=peer_timeout_seconds,
      startup_timeout_seconds=startup.startup_timeout(startup_timeout_seconds),
      resolver=resolver,
      config=config))
  logging.info("tfdp strategy: %s, %d replica(s) in sync, all_reduce=%s",
               type(strategy).__name__, strategy.num_replicas_in_sync, all_reduce)
  return strategy

