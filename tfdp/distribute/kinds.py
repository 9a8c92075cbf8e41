"""Which kind of strategy a run gets: the kinds, the all-reduce names and the choice, without TensorFlow.

`tfdp.distribute.strategy.make_strategy` builds what `choose_kind` picks; `tfdp-train`
checks its flags against the cluster here before TensorFlow starts.
"""

from __future__ import annotations

from tfdp import errors

KINDS = ("auto", "mirrored", "multi_worker", "one_device", "default")
ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduce_to_one", "ring")


def choose_kind(kind: str, *, tf_config_workers: int | None, num_gpus: int,
                cpu_replicas: int | None = None, all_reduce: str = "auto") -> str:
  """The kind of strategy `make_strategy` builds; no TensorFlow calls.

  Args:
    kind: the kind asked for (see `make_strategy`).
    tf_config_workers: number of workers the cluster (TF_CONFIG or SLURM)
      describes; None when there is no cluster.
    num_gpus: GPUs visible to this process.
    cpu_replicas: the logical CPU replicas asked for, or None.
    all_reduce: the all-reduce method asked for.

  Returns:
    One of `mirrored`, `multi_worker`, `one_device`, `default`.

  Raises:
    ConfigError: unknown kind or all-reduce, NCCL without GPUs, multi_worker
      without a cluster, or a single-host kind in a cluster of 2+ workers.
  """
  if kind not in KINDS:
    raise errors.ConfigError(f"Unknown strategy {kind!r}; choose one of {', '.join(KINDS)}.")
  if all_reduce not in ALL_REDUCE:
    raise errors.ConfigError(
        f"Unknown all_reduce {all_reduce!r}; choose one of {', '.join(ALL_REDUCE)}.")
  if all_reduce == "nccl" and not num_gpus:
    raise errors.ConfigError(
        "all_reduce='nccl' needs GPUs and none is visible; use all_reduce="
        "'ring' (across workers) or 'reduce_to_one' (between CPU replicas), or "
        "'auto'.")
  workers = tf_config_workers or 1
  if kind == "auto":
    if workers > 1:
      kind = "multi_worker"
    elif num_gpus > 1 or (not num_gpus and (cpu_replicas or 1) > 1):
      kind = "mirrored"
    elif num_gpus == 1:
      kind = "one_device"
    else:
      kind = "default"
  check_cluster(kind, tf_config_workers)
  return kind


def check_cluster(kind: str, tf_config_workers: int | None) -> None:
  """Raises ConfigError when strategy `kind` contradicts the cluster; `auto` never does.

  Args:
    kind: a kind of `KINDS`.
    tf_config_workers: number of workers the cluster describes; None when
      there is no cluster.
  """
  if kind == "multi_worker" and tf_config_workers is None:
    raise errors.ConfigError(
        "strategy 'multi_worker' needs TF_CONFIG describing the cluster; start "
        "the workers with `tfdp-launch --num_workers=N -- COMMAND`, set "
        "TF_CONFIG on each host, or run them as a SLURM job step (`srun`).")
  workers = tf_config_workers or 1
  if kind not in ("auto", "multi_worker") and workers > 1:
    raise errors.ConfigError(
        f"TF_CONFIG describes {workers} workers but strategy {kind!r} trains on "
        "one host; use --strategy=multi_worker (or auto), or unset TF_CONFIG.")
