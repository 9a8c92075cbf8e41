"""What gradient compression costs in accuracy: the same tfdp-train run with float32, bfloat16 and float16 all-reduces.

Each run is `tfdp-train` from the same seed with op determinism, on the same
batches, under a MirroredStrategy over 2 logical CPUs (each step sums the two
replicas' gradients in the compressed dtype, as across workers), with
evaluation on the held-out split at the end. Prints the final evaluation of
each and its difference from float32; with --out, writes them as JSON.

  python scripts/compression_accuracy.py --model=resnet20 --train_steps=600
"""

import json
import os
import re
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "resnet20", "Model of the registry.")
flags.DEFINE_integer("train_steps", 600, "Steps of each run.")
flags.DEFINE_integer("global_batch_size", 64, "Global batch.")
flags.DEFINE_integer("num_examples", 8192, "Synthetic examples.")
flags.DEFINE_list("compressions", ["none", "bf16", "fp16"], "The runs.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")

_EVAL = re.compile(r"eval +val_accuracy ([\d.]+), val_loss ([\d.]+)")


def _run(compression, model_dir):
  cmd = [sys.executable, "-m", "tfdp.cli.train", f"--model={FLAGS.model}", "--dataset=synthetic",
         f"--num_examples={FLAGS.num_examples}", "--strategy=mirrored", "--cpu_replicas=2",
         f"--global_batch_size={FLAGS.global_batch_size}", f"--train_steps={FLAGS.train_steps}",
         f"--eval_every_steps={FLAGS.train_steps}", "--eval_steps=16", "--deterministic",
         "--seed=0", f"--gradient_compression={compression}", f"--model_dir={model_dir}"]
  proc = subprocess.run(cmd, env=bench_common.worker_env(), cwd=bench_common.repo_root(),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
  out = proc.stdout.decode("utf-8", errors="replace")
  found = _EVAL.findall(out)
  if proc.returncode != 0 or not found:
    raise RuntimeError(f"tfdp-train --gradient_compression={compression} failed:\n{out[-3000:]}")
  accuracy, loss = found[-1]
  return {"compression": compression, "val_accuracy": float(accuracy), "val_loss": float(loss)}


def main(argv):
  del argv
  rows = []
  with tempfile.TemporaryDirectory(prefix="tfdp_compression_") as tmp:
    for compression in FLAGS.compressions:
      rows.append(_run(compression, os.path.join(tmp, compression)))
  base = rows[0]
  for row in rows:
    row["accuracy_vs_first"] = row["val_accuracy"] - base["val_accuracy"]
    row["loss_vs_first"] = row["val_loss"] / base["val_loss"] - 1
  print(f"\n{FLAGS.model}, {FLAGS.train_steps} steps of {FLAGS.global_batch_size}, synthetic data, "
        "MirroredStrategy over 2 CPUs, op determinism")
  print(bench_common.table(rows, [
      ("compression", "gradient all-reduce", None), ("val_accuracy", "val accuracy", "{:.4f}"),
      ("accuracy_vs_first", "vs first", "{:+.4f}"), ("val_loss", "val loss", "{:.4f}"),
      ("loss_vs_first", "loss vs first", "{:+.2%}")]))
  bench_common.write_json(FLAGS.out, {"machine": bench_common.machine(), "rows": rows,
                                      "command": " ".join(sys.argv)})


if __name__ == "__main__":
  app.run(main)
