"""tfdp-ckpt: list, verify, inspect and export tfdp/TF checkpoints."""

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
import tempfile

from tfdp.checkpoint.format import layout as layout_lib

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
# Keys as tfdp.resume.train_state and tfdp.resume name them (importing those loads Keras).
_RUN_CONFIG_KEY = "run_config/.ATTRIBUTES/py_state"
_STEP_KEY = "optimizer/iteration" + _VALUE_SUFFIX
_EPOCH_KEY, _STEP_IN_EPOCH_KEY = "keras_epoch" + _VALUE_SUFFIX, "keras_step_in_epoch" + _VALUE_SUFFIX
_TOPOLOGY_KEY = "data_topology" + _VALUE_SUFFIX
_DATA_PART = "data"  # tfdp.resume.DATA_KEY: the data position among the per-worker state.
# Top-level names of what tfdp and Keras's BackupAndRestore keep next to the
# user's objects (see tfdp.resume and tfdp.resume.train_state); `inspect` lists them last.
_INTERNAL = ("_CHECKPOINTABLE_OBJECT_GRAPH", layout_lib.PER_WORKER_ROOT, "save_counter",
             "data_topology", "run_config")


def parse_size(text):
  """"5GB" -> 5*10**9, "512MiB" -> 512*2**20 (Hugging Face conventions)."""
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
  if not m or m.group(2).upper() not in _SIZE_UNITS:
    raise argparse.ArgumentTypeError(
        f"bad size {text!r}: use e.g. 5GB, 500MB or 1GiB")
  return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _human(n):
  """Bytes in decimal units, as `parse_size` reads them: 812 B, 1.2 MB."""
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1000 or unit == "TB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000.0


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


class _LocalFiles:
  """What `ls` reads of a local directory, without TensorFlow (tfdp.checkpoint.format.fs has the same names)."""
  listdir = staticmethod(os.listdir)
  exists = staticmethod(os.path.exists)
  size = staticmethod(os.path.getsize)

  @staticmethod
  def read_json(path):
    try:
      with open(path, encoding="utf-8") as f:
        return json.load(f)
    except (OSError, ValueError):
      return None


def _files(path):
  if "://" not in path:
    return _LocalFiles
  from tfdp.checkpoint.format import fs  # pylint: disable=g-import-not-at-top
  return fs


def _manifest(files, prefix):
  """The manifest of `prefix` as JSON (a dict), or None when it has none (or a torn one)."""
  man = files.read_json(layout_lib.manifest_path(prefix))
  return man if isinstance(man, dict) and "files" in man and "prefix" in man else None


def _size_problems(files, prefix, man):
  """The files of `prefix` missing or of another size than its manifest says (no bytes read)."""
  problems = []
  for entry in man["files"]:
    path = os.path.join(os.path.dirname(prefix), entry["name"])
    if not files.exists(path):
      problems.append(f"{path}: missing")
    elif files.size(path) != entry["size"]:
      problems.append(f"{path}: size {files.size(path)} bytes, manifest says {entry['size']} "
                      "(truncated or overwritten)")
  return problems


def _tf_state(files, directory):
  """(latest, all) checkpoint basenames TF's `checkpoint` state file names."""
  path = os.path.join(directory, layout_lib.STATE_FILENAME)
  if not files.exists(path):
    return None, set()
  with (open(path, encoding="utf-8") if files is _LocalFiles else _gfile(path)) as f:
    text = f.read()
  names = dict(re.findall(r'^(\w+): "(.*)"$', text, re.M))
  every = re.findall(r'^all_model_checkpoint_paths: "(.*)"$', text, re.M)
  latest = names.get("model_checkpoint_path")
  return (os.path.basename(latest) if latest else None), {os.path.basename(p) for p in every}


def _gfile(path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.gfile.GFile(path, "r")


def _checkpoints(files, directory):
  """{base: {kind: [file names]}} of every checkpoint in `directory` with an index or manifest, by number."""
  layout = layout_lib.Layout(directory, None)
  found = {}
  for name in files.listdir(directory):
    parsed = layout.parse(name.rstrip("/"))
    if parsed is not None:
      found.setdefault(parsed.base, {}).setdefault(parsed.kind, []).append(name)
  return {base: kinds for base, kinds in sorted(found.items(), key=lambda b: layout_lib.number_of(b[0]))
          if {"index", "manifest"} & set(kinds)}


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
    files = _files(args.path)
    man = _manifest(files, args.path)
    problems = _size_problems(files, args.path, man) if man else []
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


def _ls_row(files, directory, base, kinds, state, checksums):
  """(checkpoint, step, size, shards, world, status) of checkpoint `base`."""
  prefix = os.path.join(directory, base)
  man = _manifest(files, prefix)
  latest = " (latest)" if base == state[0] else ""
  if man is None:  # TF's own checkpoint, a torn save, or one set aside
    data = kinds.get("data", [])
    size = sum(files.size(os.path.join(directory, f)) for f in data + kinds.get("index", []))
    if "corrupt" in kinds:
      status = f"set aside as corrupt ({os.path.basename(layout_lib.corrupt_path(prefix))})"
    elif base in state[1]:
      status = "TF checkpoint (no tfdp manifest; files not checked)" + latest
    else:
      status = "no tfdp manifest (written by TF itself, or a torn save)"
    return (base, "-", _human(size), str(len(data)) if data else "-", "-", status)
  if checksums:
    from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
    problems = manifest_lib.check_files(prefix)
  else:
    problems = _size_problems(files, prefix, man)
  # Never "intact" unchecked: sizes match says nothing of the bytes.
  checked = "verified (every byte)" if checksums else "sizes ok (bytes not read: --verify)"
  status = (checked + latest) if not problems else "CORRUPT: " + "; ".join(problems)
  return (base, str(man.get("step", "-")), _human(man.get("total_bytes", 0)),
          str(man.get("num_shards", "-")), str(man.get("world_size", "-")), status)


def cmd_ls(args, out):
  """Lists the checkpoints of a directory; reads no tensor (TensorFlow only for --checksums or a URL)."""
  files = _files(args.dir)
  state = _tf_state(files, args.dir)
  rows = [("CHECKPOINT", "STEP", "SIZE", "SHARDS", "WORLD", "STATUS")]
  rows += [_ls_row(files, args.dir, base, kinds, state, args.checksums)
           for base, kinds in _checkpoints(files, args.dir).items()]
  _table(rows, out)
  return 0


def _table(rows, out, indent=""):
  """Writes `rows` in left-aligned columns; the last column is not padded."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
  for r in rows:
    out.write(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] + "\n")


def cmd_verify(args, out):
  from tfdp.checkpoint.format import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  problems = manifest_lib.check_files(args.path)
  if problems:
    for p in problems:
      out.write(f"BAD {p}\n")
    return 1
  man = manifest_lib.read_manifest(args.path)
  out.write(f"OK {args.path}: {len(man.files)} files, "
            f"{man.total_bytes} bytes match the manifest\n")
  return 0


def _tensors(path, everything):
  """[(name, shape, dtype name, bytes, internal)] of checkpoint `path`, user objects first, and its reader."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(path)
  shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
  rows = []
  for key in shapes:
    top = key.split("/", 1)[0]
    internal = top in _INTERNAL or top.startswith("keras_")
    if internal and not everything and top != layout_lib.PER_WORKER_ROOT:
      continue
    if dtypes[key] != tf.string:
      nbytes = int(np.prod(shapes[key], dtype=np.int64)) * (dtypes[key].size or 0)
    else:  # small: a data iterator's state, the run config
      nbytes = sum(len(b) for b in np.ravel(reader.get_tensor(key)))
    name = key[:-len(_VALUE_SUFFIX)] if key.endswith(_VALUE_SUFFIX) else key
    rows.append((name, list(shapes[key]), dtypes[key].name, nbytes, internal))
  order = {"model": 0, "optimizer": 1}
  rows.sort(key=lambda r: (r[4], order.get(r[0].split("/", 1)[0], 2), r[0]))
  return reader, rows


def _scalar(reader, key):
  """The value of scalar tensor `key` (an int or the text of a string), or None."""
  if not reader.has_tensor(key):
    return None
  value = reader.get_tensor(key)
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else int(value)


def _position(reader, step):
  """`12 (epoch 2, step 4 of it)`: the step and where Keras's epochs are at it."""
  epoch, in_epoch = _scalar(reader, _EPOCH_KEY), _scalar(reader, _STEP_IN_EPOCH_KEY)
  if epoch is None:
    return str(step)
  if in_epoch is not None and in_epoch > 0:
    return f"{step} (epoch {epoch + 1}, step {in_epoch} of it)"
  return f"{step} ({epoch} epoch{'s' if epoch != 1 else ''} done)"


def _summary(path, reader, rows):
  """(label, text) lines of what the checkpoint is: step, epoch, world, tier, run config, sizes."""
  man = _manifest(_files(path), path) or {}
  config = json.loads(_scalar(reader, _RUN_CONFIG_KEY) or "{}")
  config.pop("state_version", None)
  step = man.get("step", _scalar(reader, _STEP_KEY))
  world = man.get("world_size", config.get("world_size"))
  batch = man.get("global_batch_size") or config.get("global_batch_size")
  lines = [("checkpoint", f"{path} " + (f"(tfdp, manifest version {man.get('manifest_version', 1)})"
                                        if man else "(no tfdp manifest: TF's own format)"))]
  if step is not None:
    lines.append(("step", _position(reader, step)))
  if world is not None:
    lines.append(("world size", f"{world} worker{'s' if world != 1 else ''}"
                  + (f", global batch {batch}" if batch else "")))
  if man:
    saved = datetime.datetime.fromtimestamp(man.get("time", 0)).strftime("%Y-%m-%d %H:%M:%S")
    versions = ", ".join(f"{k} {man['versions'][k]}" for k in ("tfdp", "tensorflow", "keras")
                         if k in man.get("versions", {}))
    lines += [("tier", man.get("tier", "persistent")),
              ("saved", saved + (f" by {versions}" if versions else "")),
              ("size", f"{_human(man.get('total_bytes', 0))} in {man.get('num_shards', '?')} "
                       "data file(s) and an index")]
    if man.get("metrics"):
      lines.append(("metrics", _metrics(man["metrics"])))
  per_worker, data = {}, {}
  for name, _, _, nbytes, _ in rows:
    if name.startswith(layout_lib.PER_WORKER_ROOT + "/"):
      worker, part = name.split("/")[1:3]
      per_worker[int(worker)] = per_worker.get(int(worker), 0) + nbytes
      if part == _DATA_PART:
        data[int(worker)] = data.get(int(worker), 0) + nbytes
  topology = reader.get_tensor(_TOPOLOGY_KEY) if reader.has_tensor(_TOPOLOGY_KEY) else [0, 0]
  if per_worker:
    lines.append(("per-worker", ", ".join(f"worker {w}: {_human(n)}" for w, n in sorted(
        per_worker.items())) + ("; data positions of {} worker(s) x {} replica(s)".format(
            *topology) if any(topology) else "")))
  total = man.get("total_bytes") or sum(r[3] for r in rows)
  if any(data.values()):
    lines.append(("data position", ", ".join(f"worker {w}: {_human(n)}" for w, n in sorted(
        data.items())) + f" ({sum(data.values()) / max(1, total):.0%} of the checkpoint's "
                         f"{_human(total)})"))
  if config:
    lines.append(("run config", ", ".join(
        f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(config.items()))))
  return lines


def _metrics(metrics):
  """`epoch 2: accuracy 0.5, loss 1.2`: the metrics a backup holds, and the epoch they are of."""
  metrics = dict(metrics)
  epoch = metrics.pop("epoch", None)
  text = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
  return f"epoch {epoch:.0f}: {text}" if epoch is not None else text


def cmd_inspect(args, out):
  """Prints what a checkpoint is (a summary), then the user's variables by their Keras paths."""
  reader, rows = _tensors(args.path, args.all)
  summary = _summary(args.path, reader, rows)
  width = max(len(label) for label, _ in summary)
  for label, text in summary:
    out.write(f"{label.ljust(width)}  {text}\n")
  shown = [r for r in rows if args.all or not r[4]]
  hidden = len(reader.get_variable_to_shape_map()) - len(shown)
  table = [("VARIABLE", "SHAPE", "DTYPE", "SIZE")]
  table += [(name, str(shape), dtype, _human(nbytes)) for name, shape, dtype, nbytes, _ in shown]
  out.write("\n")
  _table(table, out)
  groups = {}
  for name, _, _, nbytes, internal in shown:
    group = "internal" if internal else name.split("/", 1)[0]
    groups[group] = groups.get(group, 0) + nbytes
  out.write(f"{len(shown)} tensors, {_human(sum(groups.values()))} (" + ", ".join(
      f"{g} {_human(n)}" for g, n in groups.items()) + ")" + (
      f"; {hidden} internal entries (object graph, per-worker state, counters, run and model "
      "config) not listed: --all lists them\n" if hidden else "\n"))
  return 0


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
  ls.set_defaults(fn=cmd_ls)
  v = sub.add_parser("verify", help="exit 0 only if every file matches the "
                     "manifest")
  v.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  v.set_defaults(fn=cmd_verify)
  i = sub.add_parser("inspect", help="a summary (step, epoch, world size, run config), then "
                     "the variables: shapes, dtypes, sizes")
  i.add_argument("path", help="checkpoint prefix, e.g. DIR/ckpt-5")
  i.add_argument("--all", action="store_true",
                 help="also list what tfdp and Keras keep next to the variables (object "
                 "graph, per-worker state, counters, run config)")
  i.set_defaults(fn=cmd_inspect)
  e = sub.add_parser(
      "export", help="export the model: Hugging Face safetensors (weights only by "
      "default), or a .keras file plain Keras loads (checkpoints of BackupAndRestore, "
      "tfdp.TrainState, tfdp-train)")
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
