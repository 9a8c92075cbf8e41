"""tfdp-ckpt: list, verify, inspect and export tfdp/TF checkpoints."""

import argparse
import contextlib
import os
import sys
import tempfile

from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import units
from tfdp.cli import ckpt_inspect
from tfdp.cli import ckpt_list

@contextlib.contextmanager
def _tf_start_up_hidden():
  """Runs the body with stderr (fd 2) in a file, then writes it back less TF's start-up lines.

  TF's C++ logs its start-up (oneDNN, CUDA drivers, cuInit) before it reads
  TF_CPP_MIN_LOG_LEVEL, so only the process's own stderr can hold them back.
  Every other line, errors included, is written back, in order.
  """
  from tfdp.launch import noise  # pylint: disable=g-import-not-at-top
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # no stderr to hold back
    yield
    return
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kind = None
      for line in held.read().decode("utf-8", errors="replace").splitlines():
        kind = noise.noise_kind(kind, line)
        if kind is None:
          sys.stderr.write(line + "\n")
      sys.stderr.flush()


class UsageError(Exception):
  """A bad path or argument: one line, exit 2."""


def _check_paths(args):
  """Checks every path argument before any checkpoint is read."""
  if args.command == "ls":
    if not os.path.isdir(args.dir) and "://" not in args.dir:
      raise UsageError(f"{args.dir}: not a directory of checkpoints")
    return
  index, manifest = layout_lib.index_path(args.path), layout_lib.manifest_path(args.path)
  if "://" not in args.path:
    if os.path.isdir(args.path):
      raise UsageError(f"{args.path}: a directory; pass a checkpoint prefix such as "
                       f"{os.path.join(args.path, 'ckpt-5')} (tfdp-ckpt ls lists them)")
    if args.command != "verify" and not os.path.exists(index):
      raise UsageError(f"{args.path}: no checkpoint there ({index} is missing)")
    if args.command == "verify" and not (os.path.exists(index) or os.path.exists(manifest)):
      raise UsageError(f"{args.path}: no checkpoint there (neither {index} nor {manifest})")
  if args.command == "export":
    _check_export_args(args)
  if args.command in ("inspect", "export"):
    problems = ckpt_list.size_problems(args.path)
    if problems:
      raise UsageError(f"{problems[0]}: the checkpoint is damaged (tfdp-ckpt verify "
                       "lists every bad file)")


def _check_export_args(args):
  names_file = args.format == "keras" and args.out.endswith(".keras")
  if not names_file and os.path.exists(args.out) and not os.path.isdir(args.out):
    raise UsageError(f"{args.out}: exists and is not a directory")
  if args.format != "keras":
    if "://" in args.out:
      raise UsageError(f"{args.out}: safetensors are written to a local folder; copy "
                       "them from there")
    return
  for flag, given in (("--include_optimizer", args.include_optimizer),
                      ("--max_shard_size", args.max_shard_size is not None)):
    if given:
      raise UsageError(f"{flag} applies to --format=safetensors only (a .keras file "
                       "holds the model's weights, no optimizer)")
  target = _keras_target(args)
  if os.path.isdir(target):
    raise UsageError(f"{target}: a directory; pass OUT ending in .keras, or a folder")
  if os.path.exists(target) and not args.overwrite:
    raise UsageError(f"{target} exists; pass --overwrite to replace it, or another OUT")


def _keras_target(args):
  """The .keras file `--format=keras` writes: OUT itself when it ends in .keras, else OUT/model.keras."""
  from tfdp.app import export  # pylint: disable=g-import-not-at-top
  return args.out if args.out.endswith(".keras") else os.path.join(args.out, export.KERAS_FILE)


def cmd_export(args, out):
  from tfdp.app import export  # pylint: disable=g-import-not-at-top
  if args.format == "keras":
    import keras  # pylint: disable=g-import-not-at-top
    # The rebuilt layers must get the names a fresh process gives them (Keras
    # numbers unnamed ones per process), which the checkpoint's keys hold;
    # main() may run inside a process that built models before.
    keras.backend.clear_session()
    path = export.keras_from_checkpoint(args.path, _keras_target(args))
    out.write(f"wrote {path}\n")
    return 0
  from tfdp.app import safetensors as safetensors_export  # pylint: disable=g-import-not-at-top
  result = safetensors_export.save_safetensors(
      args.path, args.out, include_optimizer=args.include_optimizer,
      max_shard_size=(safetensors_export.DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None
                      else args.max_shard_size),
      overwrite=args.overwrite)
  shards = len(result.files) - (safetensors_export.SAFETENSORS_INDEX in result.files)
  out.write(f"wrote {len(result.names)} tensors, {result.total_size} bytes in {shards} "
            f"file(s) to {args.out}")
  if result.left_out:
    out.write(f"; left out {len(result.left_out)} optimizer/RNG tensors "
              "(--include_optimizer adds them)")
  out.write("\n")
  return 0


def build_parser():
  p = argparse.ArgumentParser(prog="tfdp-ckpt", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  ls = sub.add_parser("ls", help="list checkpoints with step, size, shards, "
                      "world size and what was checked: the sizes (fast), or every byte "
                      "with --verify")
  ls.add_argument("dir")
  ls.add_argument("--verify", "--checksums", dest="checksums", action="store_true",
                  help="also check the bytes (reads every byte: the index's CRC-32, each "
                  "tensor's CRC32C), as `tfdp-ckpt verify` does")
  ls.set_defaults(fn=ckpt_list.cmd_ls)
  v = sub.add_parser("verify", help="exit 0 only if every file matches the "
                     "manifest")
  v.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  v.set_defaults(fn=ckpt_list.cmd_verify)
  i = sub.add_parser("inspect", help="a summary (step, epoch, world size, run config), then "
                     "the variables: shapes, dtypes, sizes")
  i.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  i.add_argument("--all", action="store_true",
                 help="also list what tfdp and Keras keep next to the variables (object "
                 "graph, per-worker state, counters, run config)")
  i.set_defaults(fn=ckpt_inspect.cmd_inspect)
  e = sub.add_parser(
      "export", help="export the model: Hugging Face safetensors (weights only by "
      "default), or a .keras file plain Keras loads (checkpoints of BackupAndRestore, "
      "tfdp.TrainState, tfdp-train)")
  e.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  e.add_argument("out", help="output folder (keras: also a path ending in .keras)")
  e.add_argument("--format", default="safetensors", choices=["safetensors", "keras"])
  e.add_argument("--include_optimizer", action="store_true",
                 help="safetensors: also the optimizer's slots and step, and the RNG state")
  e.add_argument("--max_shard_size", type=units.parse_size, default=None,
                 help="safetensors: most bytes per file (default 5GB)")
  e.add_argument("--overwrite", action="store_true",
                 help="remove the safetensors files already in OUT first (keras: "
                 "replace the file)")
  e.set_defaults(fn=cmd_export)
  return p


def main(argv=None, out=None, err=None):
  """Runs the tool on `argv` (without the program name); returns the exit code.

  A bad path or argument (a ConfigError included), or a checkpoint that
  cannot be read, is one line on `err` and exit code 2.
  """
  args = build_parser().parse_args(argv)
  err = err or sys.stderr
  try:
    _check_paths(args)
    return args.fn(args, out or sys.stdout)
  except UsageError as e:
    err.write(f"tfdp-ckpt: error: {e}\n")
    return 2
  except Exception as e:  # pylint: disable=broad-except
    from tfdp import errors  # pylint: disable=g-import-not-at-top
    if isinstance(e, errors.ConfigError):
      err.write(f"tfdp-ckpt: error: {' '.join(str(e).split())}\n")
      return 2
    if not _unreadable(e):
      raise
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    err.write(f"tfdp-ckpt: error: {getattr(args, 'path', None) or args.dir}: cannot read the "
              f"checkpoint ({type(e).__name__}: {first}); `tfdp-ckpt verify` names the "
              "bad file\n")
    return 2


def _unreadable(e):
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  tf = sys.modules.get("tensorflow")  # not loaded: no TF error (`ls` runs without it)
  return isinstance(e, (OSError, IndexError, errors.CheckpointError)
                    + ((tf.errors.OpError,) if tf is not None else ()))


def run():
  """Console entry point of `tfdp-ckpt`: `main` without TF's start-up lines on stderr."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TF's C++ INFO lines; warnings still show
  with _tf_start_up_hidden():
    code = main(sys.argv[1:])
  sys.exit(code)


if __name__ == "__main__":
  run()
