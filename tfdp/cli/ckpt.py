"""tfdp-ckpt: list, verify, inspect and export tfdp/TF checkpoints."""

import argparse
import os
import re
import sys

import numpy as np

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}


def parse_size(text):
  """"5GB" -> 5*10**9, "512MiB" -> 512*2**20 (Hugging Face conventions)."""
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
  if not m or m.group(2).upper() not in _SIZE_UNITS:
    raise argparse.ArgumentTypeError(
        f"bad size {text!r}: use e.g. 5GB, 500MB or 1GiB")
  return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _human(n):
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1000 or unit == "TB":
      return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
    n /= 1000.0


def _checkpoints(directory):
  """(prefix, manifest or None) of every checkpoint in `directory`, by number."""
  from tfdp.checkpoint import catalog  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint import layout as layout_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  found = catalog.scan(layout_lib.Layout(directory, None))
  prefixes = [os.path.join(directory, base) for base, kinds in found.items()
              if kinds & {"index", "manifest"}]
  return [(p, manifest_lib.read_manifest(p))
          for p in sorted(prefixes, key=layout_lib.number_of)]


class UsageError(Exception):
  """A bad path or argument: one line, exit 2."""


def _check_paths(args):
  """Checks every path argument before any checkpoint is read."""
  if args.command == "ls":
    if not os.path.isdir(args.dir) and "://" not in args.dir:
      raise UsageError(f"{args.dir}: not a directory of checkpoints")
    return
  from tfdp.checkpoint import layout as layout_lib  # pylint: disable=g-import-not-at-top
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
    from tfdp.checkpoint import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
    man = manifest_lib.read_manifest(args.path)
    problems = manifest_lib.check_files(args.path, man, checksums=False) if man else []
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


def cmd_ls(args, out):
  from tfdp.checkpoint import layout as layout_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  rows = [("CHECKPOINT", "STEP", "SIZE", "SHARDS", "WORLD", "STATUS")]
  for prefix, man in _checkpoints(args.dir):
    if man is None:
      aside = layout_lib.corrupt_path(prefix)
      rows.append((os.path.basename(prefix), "-", "-", "-", "-",
                   f"set aside as corrupt ({os.path.basename(aside)})" if os.path.exists(aside)
                   else "no tfdp manifest (written by TF itself, or a torn save)"))
      continue
    problems = manifest_lib.check_files(prefix, man, checksums=args.checksums)
    status = "intact" if not problems else "CORRUPT: " + "; ".join(problems)
    rows.append((os.path.basename(prefix), str(man.step), _human(man.total_bytes),
                 str(man.num_shards), str(man.world_size), status))
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  for r in rows:
    out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5] +
              "\n")
  return 0


def cmd_verify(args, out):
  from tfdp.checkpoint import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  problems = manifest_lib.check_files(args.path)
  if problems:
    for p in problems:
      out.write(f"BAD {p}\n")
    return 1
  man = manifest_lib.read_manifest(args.path)
  out.write(f"OK {args.path}: {len(man.files)} files, "
            f"{man.total_bytes} bytes match the manifest\n")
  return 0


def _variables(path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(path)
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  return reader, [(k, shapes[k], dtypes[k]) for k in sorted(shapes)]


def cmd_inspect(args, out):
  from tfdp.checkpoint import layout  # pylint: disable=g-import-not-at-top
  reader, variables = _variables(args.path)
  total = 0
  per_worker = {}
  for key, shape, dtype in variables:
    if dtype.name != "string":
      nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size
    elif key.startswith(layout.PER_WORKER_ROOT + "/"):  # Small: e.g. a data iterator's state.
      nbytes = sum(len(b) for b in np.ravel(reader.get_tensor(key)))
    else:
      nbytes = 0
    if key.startswith(layout.PER_WORKER_ROOT + "/"):
      worker = int(key.split("/")[1])
      per_worker[worker] = per_worker.get(worker, 0) + nbytes
    total += nbytes
    out.write(f"{key}\t{list(shape)}\t{dtype.name}\t{nbytes}\n")
  out.write(f"# {len(variables)} tensors, {total} bytes\n")
  if per_worker:
    out.write("# per-worker state (e.g. the data iterator): " + ", ".join(
        f"worker {w} {n} bytes" for w, n in sorted(per_worker.items())) + "\n")
  return 0


def _keras_target(args):
  """The .keras file `--format=keras` writes: OUT itself when it ends in .keras, else OUT/model.keras."""
  from tfdp import export  # pylint: disable=g-import-not-at-top
  return args.out if args.out.endswith(".keras") else os.path.join(args.out, export.KERAS_FILE)


def cmd_export(args, out):
  from tfdp import export  # pylint: disable=g-import-not-at-top
  if args.format == "keras":
    import keras  # pylint: disable=g-import-not-at-top
    # The rebuilt layers must get the names a fresh process gives them (Keras
    # numbers unnamed ones per process), which the checkpoint's keys hold;
    # main() may run inside a process that built models before.
    keras.backend.clear_session()
    path = export.keras_from_checkpoint(args.path, _keras_target(args))
    out.write(f"wrote {path}\n")
    return 0
  result = export.save_safetensors(
      args.path, args.out, include_optimizer=args.include_optimizer,
      max_shard_size=(export.DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None
                      else args.max_shard_size),
      overwrite=args.overwrite)
  shards = len(result.files) - (export.SAFETENSORS_INDEX in result.files)
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
                      "world size and whether intact")
  ls.add_argument("dir")
  ls.add_argument("--checksums", action="store_true",
                  help="also check the bytes (reads every byte: the index's CRC-32, each "
                  "tensor's CRC32C)")
  ls.set_defaults(fn=cmd_ls)
  v = sub.add_parser("verify", help="exit 0 only if every file matches the "
                     "manifest")
  v.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  v.set_defaults(fn=cmd_verify)
  i = sub.add_parser("inspect", help="variables, shapes, dtypes, bytes")
  i.add_argument("path")
  i.set_defaults(fn=cmd_inspect)
  e = sub.add_parser(
      "export", help="export the model: Hugging Face safetensors (weights only by "
      "default), or a .keras file plain Keras loads (tfdp-train checkpoints)")
  e.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  e.add_argument("out", help="output folder (keras: also a path ending in .keras)")
  e.add_argument("--format", default="safetensors", choices=["safetensors", "keras"])
  e.add_argument("--include_optimizer", action="store_true",
                 help="safetensors: also the optimizer's slots and step, and the RNG state")
  e.add_argument("--max_shard_size", type=parse_size, default=None,
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
    err.write(f"tfdp-ckpt: error: {getattr(args, 'path', '')}: cannot read the "
              f"checkpoint ({type(e).__name__}: {first}); `tfdp-ckpt verify` names the "
              "bad file\n")
    return 2


def _unreadable(e):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdp import errors  # pylint: disable=g-import-not-at-top
  return isinstance(e, (tf.errors.OpError, IndexError, errors.CheckpointError))


def run():
  """Console entry point of `tfdp-ckpt`."""
  sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
  run()
