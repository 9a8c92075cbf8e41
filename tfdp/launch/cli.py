"""The command line of tfdp-launch: flags to `LaunchOptions`, one line and exit 2 for usage errors."""

import argparse
import shlex
import sys
from typing import NoReturn, Optional, Sequence

from tfdp import errors
from tfdp.launch import exits
from tfdp.launch import noise
from tfdp.launch import procs
from tfdp.launch.job import EXIT_OK
from tfdp.launch.job import EXIT_USAGE
from tfdp.launch.job import EXIT_WORKER_FAILED
from tfdp.launch.job import LaunchOptions
from tfdp.launch.job import launch


def _parser():
  parser = argparse.ArgumentParser(
      prog="tfdp-launch",
      description="Run COMMAND as N workers, each with its own TF_CONFIG; "
                  "restart the group when a worker fails.",
      usage="tfdp-launch --num_workers=N [--max_restarts=K] [...] -- COMMAND [ARGS...]",
      epilog=f"Exit codes: {EXIT_OK} every worker exited 0; {EXIT_WORKER_FAILED} "
             f"a worker failed and no restart was left, or the workers did not "
             f"answer a signal; {EXIT_USAGE} usage error; {exits.EXIT_PREEMPTED} "
             "the launcher was signalled and the workers saved (run again to "
             "resume).")
  parser.add_argument("--num_workers", type=int, default=None,
                      help="number of worker processes (default 2, or one per --hosts)")
  parser.add_argument("--port", type=int, default=None,
                      help="first port; workers use consecutive ports "
                           "(default: free ports, new at every restart)")
  parser.add_argument("--grace_seconds", type=float,
                      default=procs.DEFAULT_GRACE_SECONDS,
                      help="seconds between the forwarded SIGTERM/SIGINT and "
                           "SIGKILL when stopping workers")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="restart the whole group up to K times when a "
                           "worker exits non-zero, is killed or hangs")
  parser.add_argument("--hang_timeout", type=float, default=0.0,
                      help="a worker with no heartbeat for this many seconds "
                           "counts as failed (0: off)")
  parser.add_argument("--startup_timeout", type=float, default=None,
                      help="the hang limit before a worker's first heartbeat "
                           f"(default max(hang_timeout, {procs.DEFAULT_STARTUP_TIMEOUT:g}))")
  parser.add_argument("--elastic", action="store_true",
                      help="leave out a worker slot that keeps failing (down "
                           "to --min_workers) with the same global batch")
  parser.add_argument("--min_workers", type=int, default=1,
                      help="the fewest workers of an --elastic job")
  parser.add_argument("--slot_failures", type=int, default=2,
                      help="attempts in a row a slot must be blamed for to be "
                           "left out (--elastic)")
  parser.add_argument("--slot_check", default=None,
                      help="shell command ({slot}, {host}) that exits 0 when a "
                           "left-out slot may return (--elastic; default: "
                           "retry it after one attempt)")
  parser.add_argument("--hosts", default=None,
                      help="comma-separated address of each worker slot "
                           "(default localhost)")
  parser.add_argument("--wrapper", default=None,
                      help="command prefix of each worker, formatted with "
                           "{slot}, {index}, {host}; e.g. 'ip netns exec ns{slot}'")
  parser.add_argument("--verbose_workers", action="store_true",
                      help="print every worker line as it comes (also: "
                           f"{noise.ENV_SHOW_TF_LOGS}=1); by default known "
                           "TF/gRPC start-up and shutdown noise is not printed "
                           "(a failed job counts it), and an error that several "
                           "workers print is printed once")
  return parser


def parse(argv: Sequence[str]) -> tuple[list[str], int, LaunchOptions]:
  """Splits `tfdp-launch FLAGS -- COMMAND` into (command, num_workers, options).

  Argparse errors (and a missing COMMAND) exit 2 with the usage; the values
  themselves are checked by `LaunchOptions.check`.
  """
  argv = list(argv)
  if "--" in argv:
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1:]
  else:
    own, command = argv, []
  parser = _parser()
  args = parser.parse_args(own)
  if not command:
    parser.error("no COMMAND given after `--`")
  hosts = args.hosts.split(",") if args.hosts else None
  num_workers = args.num_workers
  if num_workers is None:
    num_workers = len(hosts) if hosts else 2
  options = LaunchOptions(
      port=args.port, grace_seconds=args.grace_seconds,
      max_restarts=args.max_restarts, hang_timeout=args.hang_timeout,
      startup_timeout=args.startup_timeout, elastic=args.elastic,
      min_workers=args.min_workers, slot_failures=args.slot_failures,
      slot_check=args.slot_check, hosts=hosts,
      wrapper=shlex.split(args.wrapper) if args.wrapper else None,
      verbose_workers=args.verbose_workers)
  return command, num_workers, options


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs tfdp-launch with `argv` (default: sys.argv[1:]); returns its exit code."""
  command, num_workers, options = parse(sys.argv[1:] if argv is None else argv)
  try:
    return launch(command, num_workers, options=options)
  except errors.TfdpError as e:
    print(f"tfdp-launch: error: {e}", file=sys.stderr)
    return EXIT_USAGE


def run(argv: Optional[Sequence[str]] = None) -> NoReturn:
  """Console entry point of `tfdp-launch`: `main`, then exit with its code."""
  sys.exit(main(argv))
