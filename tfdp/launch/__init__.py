"""tfdp-launch: runs N worker processes of one command and restarts the group when one fails.

The launcher knows nothing of TensorFlow and never imports it (a test
checks): it starts in a fraction of a second and stays small.

Owns:
- cli.py: the flags (and __main__.py: `python -m tfdp.launch`);
- job.py: the restart loop and its LaunchOptions;
- procs.py: one group of worker processes: start, watch, stop;
- exits.py: what a worker's exit code says, and whom to blame;
- elastic.py: which slots an elastic restart uses;
- addresses.py: ports, the cluster spec, each worker's TF_CONFIG;
- signals.py: signals forwarded to the workers, the parent-death signal;
- output.py: the one output stream and the chief's progress bar;
- worker_lines.py: every worker's lines on their way to it;
- noise.py: known TF/gRPC noise, held back.
May import: tfdp.goodput, tfdp.errors.
"""

from tfdp.launch.addresses import cluster_spec
from tfdp.launch.addresses import free_ports
from tfdp.launch.addresses import tf_config
from tfdp.launch.cli import main
from tfdp.launch.cli import run
from tfdp.launch.job import EXIT_OK
from tfdp.launch.job import EXIT_USAGE
from tfdp.launch.job import EXIT_WORKER_FAILED
from tfdp.launch.job import LaunchOptions
from tfdp.launch.job import launch
from tfdp.launch.procs import DEFAULT_GRACE_SECONDS
from tfdp.launch.procs import DEFAULT_STARTUP_TIMEOUT
from tfdp.launch.procs import ENV_HEARTBEAT_FILE
from tfdp.launch.procs import ENV_RESTART_COUNT
from tfdp.launch.exits import EXIT_COLLECTIVE_TIMEOUT
from tfdp.launch.exits import EXIT_PEER_LOST
from tfdp.launch.exits import EXIT_PREEMPTED
from tfdp.launch.procs import FAILED_GROUP_GRACE_SECONDS
from tfdp.launch.exits import Failure
from tfdp.launch.procs import Launcher
from tfdp.launch.exits import first_failure
from tfdp.launch.elastic import Slots

__all__ = [
    "DEFAULT_GRACE_SECONDS", "DEFAULT_STARTUP_TIMEOUT", "ENV_HEARTBEAT_FILE",
    "ENV_RESTART_COUNT", "EXIT_COLLECTIVE_TIMEOUT", "EXIT_OK", "EXIT_PEER_LOST", "EXIT_PREEMPTED",
    "EXIT_USAGE", "EXIT_WORKER_FAILED", "FAILED_GROUP_GRACE_SECONDS", "Failure",
    "LaunchOptions", "Launcher", "Slots", "cluster_spec", "first_failure",
    "free_ports", "launch", "main", "run", "tf_config",
]
