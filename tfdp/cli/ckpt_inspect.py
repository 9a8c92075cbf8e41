"""tfdp-ckpt's `inspect`: what a checkpoint is (step, epoch, world size, run config, sizes), then its variables."""

import datetime
import json

from tfdp.checkpoint.format import layout as layout_lib
from tfdp.checkpoint.format import manifest as manifest_lib
from tfdp.checkpoint.format import units
from tfdp.cli import ckpt_list

_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
# Keys as tfdp.resume.train_state and tfdp.resume.position name them (importing those loads Keras).
_RUN_CONFIG_KEY = "run_config/.ATTRIBUTES/py_state"
_STEP_KEY = "optimizer/iteration" + _VALUE_SUFFIX
_EPOCH_KEY, _STEP_IN_EPOCH_KEY = "keras_epoch" + _VALUE_SUFFIX, "keras_step_in_epoch" + _VALUE_SUFFIX
_TOPOLOGY_KEY = "data_topology" + _VALUE_SUFFIX
_DATA_PART = "data"  # tfdp.resume.position.DATA_KEY: the data position among the per-worker state.
# Top-level names of what tfdp and Keras's BackupAndRestore keep next to the
# user's objects (see tfdp.resume and tfdp.resume.train_state); `inspect` lists them last.
_INTERNAL = ("_CHECKPOINTABLE_OBJECT_GRAPH", layout_lib.PER_WORKER_ROOT, "save_counter",
             "data_topology", "run_config")



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
  man = manifest_lib.read_manifest(path)
  config = json.loads(_scalar(reader, _RUN_CONFIG_KEY) or "{}")
  config.pop("state_version", None)
  step = man.step if man else _scalar(reader, _STEP_KEY)
  world = man.world_size if man else config.get("world_size")
  batch = (man.global_batch_size if man else None) or config.get("global_batch_size")
  lines = [("checkpoint", f"{path} " + (f"(tfdp, manifest version {man.manifest_version})"
                                        if man else "(no tfdp manifest: TF's own format)"))]
  if step is not None:
    lines.append(("step", _position(reader, step)))
  if world is not None:
    lines.append(("world size", f"{world} worker{'s' if world != 1 else ''}"
                  + (f", global batch {batch}" if batch else "")))
  if man:
    saved = datetime.datetime.fromtimestamp(man.time).strftime("%Y-%m-%d %H:%M:%S")
    versions = ", ".join(f"{k} {man.versions[k]}" for k in ("tfdp", "tensorflow", "keras")
                         if k in man.versions)
    lines += [("tier", man.tier),
              ("saved", saved + (f" by {versions}" if versions else "")),
              ("size", f"{units.human_bytes(man.total_bytes)} in {man.num_shards} "
                       "data file(s) and an index")]
    if man.metrics:
      lines.append(("metrics", _metrics(man.metrics)))
  per_worker, data = {}, {}
  for name, _, _, nbytes, _ in rows:
    if name.startswith(layout_lib.PER_WORKER_ROOT + "/"):
      worker, part = name.split("/")[1:3]
      per_worker[int(worker)] = per_worker.get(int(worker), 0) + nbytes
      if part == _DATA_PART:
        data[int(worker)] = data.get(int(worker), 0) + nbytes
  topology = reader.get_tensor(_TOPOLOGY_KEY) if reader.has_tensor(_TOPOLOGY_KEY) else [0, 0]
  if per_worker:
    lines.append(("per-worker", ", ".join(f"worker {w}: {units.human_bytes(n)}" for w, n in sorted(
        per_worker.items())) + ("; data positions of {} worker(s) x {} replica(s)".format(
            *topology) if any(topology) else "")))
  total = (man.total_bytes if man else 0) or sum(r[3] for r in rows)
  if any(data.values()):
    lines.append(("data position", ", ".join(f"worker {w}: {units.human_bytes(n)}" for w, n in sorted(
        data.items())) + f" ({sum(data.values()) / max(1, total):.0%} of the checkpoint's "
                         f"{units.human_bytes(total)})"))
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
  table += [(name, str(shape), dtype, units.human_bytes(nbytes)) for name, shape, dtype, nbytes, _ in shown]
  out.write("\n")
  ckpt_list.table(table, out)
  groups = {}
  for name, _, _, nbytes, internal in shown:
    group = "internal" if internal else name.split("/", 1)[0]
    groups[group] = groups.get(group, 0) + nbytes
  out.write(f"{len(shown)} tensors, {units.human_bytes(sum(groups.values()))} (" + ", ".join(
      f"{g} {units.human_bytes(n)}" for g, n in groups.items()) + ")" + (
      f"; {hidden} internal entries (object graph, per-worker state, counters, run and model "
      "config) not listed: --all lists them\n" if hidden else "\n"))
  return 0
