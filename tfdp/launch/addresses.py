"""What tells the workers where they are: free ports, the cluster spec, each worker's TF_CONFIG."""

import json
import socket
from typing import Optional, Sequence

from tfdp import errors


def free_ports(n: int, host: str = "localhost") -> list[int]:
  """Returns `n` distinct TCP ports that are free on `host` right now.

  All sockets are held open until every port is chosen, so the ports are
  distinct; another process may still take one before the worker binds it,
  which is the usual race of every local launcher and is rare in practice.
  """
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def cluster_spec(num_workers: int, port: Optional[int] = None,
                 host: str = "localhost",
                 hosts: Optional[Sequence[str]] = None) -> dict:
  """The `cluster` part of TF_CONFIG for `num_workers` workers.

  Args:
    num_workers: number of worker tasks.
    port: first port; workers use `port, port+1, ...`. None picks ports that
      are free on this machine (also used for `hosts`, which are expected to
      be fresh network namespaces or otherwise idle).
    host: the address every worker listens on.
    hosts: one address per worker instead of `host`.

  Returns:
    A dict `{"worker": ["host:port", ...]}`.

  Raises:
    ConfigError: if `num_workers` < 1 or `hosts` does not name one per worker.
  """
  if num_workers < 1:
    raise errors.ConfigError(f"--num_workers must be >= 1, got {num_workers}.")
  if hosts is not None and len(hosts) != num_workers:
    raise errors.ConfigError(
        f"{len(hosts)} host(s) given for {num_workers} worker(s); give one per worker.")
  hosts = list(hosts) if hosts is not None else [host] * num_workers
  ports = (free_ports(num_workers, "localhost") if port is None else
           [port + i for i in range(num_workers)])
  return {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}


def tf_config(cluster: dict, index: int) -> str:
  """The TF_CONFIG string of worker `index` in `cluster`."""
  return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
