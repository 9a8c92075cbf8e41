"""The data position's size in a backup of plain `model.fit`, for a pipeline of decoded images and for each remedy.

Usage: python scripts/data_position_size.py [--images=10000] [--side=32] [--buffer=10000]

Each pipeline reads --images PNG-encoded RGB images of --side pixels (random
noise, which PNG cannot compress: about 3 KB each), decodes them to float32
(12 KB each at 32x32), then batches 32 and prefetches 2 batches:

  decode, then shuffle(B)        the usual order: the buffer holds decoded images
  decode, then shuffle(B/10)     a smaller shuffle buffer
  shuffle(B) of the files' bytes, then decode
  shuffle(B) of indices, then read and decode
                                 the buffer holds file names or indices (8 bytes)
  global shuffle, then read and decode
                                 tf.data's global shuffle over a random-access
                                 source (range, then map): no buffer at all

For each, one process runs `model.fit` on a small model with
`tfdp.callbacks.BackupAndRestore(save_freq=5)` for 10 steps and prints the
backup's per-worker state (the data position), its share of the backup and
the time training was blocked by the backup at step 5 (the first: it takes
the whole iterator state). Numbers in
docs/data.md#state-size.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("decoded", "small_buffer", "encoded", "indices", "global")
TITLES = {"decoded": "decode, then shuffle(B)", "small_buffer": "decode, then shuffle(B/10)",
          "encoded": "shuffle(B) of the files' bytes, then decode",
          "indices": "shuffle(B) of indices, then read and decode",
          "global": "global shuffle, then read and decode"}


def _pipeline(variant, images, side, buffer):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.data.experimental.ops import global_shuffle_op  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  pixels = rng.integers(0, 256, size=(images, side, side, 3), dtype=np.uint8)
  files = tf.constant([tf.io.encode_png(p).numpy() for p in pixels])
  labels = tf.constant(rng.integers(0, 10, images), tf.int32)

  def decode(png, label):
    return tf.cast(tf.io.decode_png(png, channels=3), tf.float32) / 255.0, label

  def read(i):
    return decode(tf.gather(files, i), tf.gather(labels, i))

  examples = tf.data.Dataset.from_tensor_slices((files, labels))
  if variant == "decoded":
    ds = examples.map(decode).shuffle(buffer, seed=1)
  elif variant == "small_buffer":
    ds = examples.map(decode).shuffle(buffer // 10, seed=1)
  elif variant == "encoded":
    ds = examples.shuffle(buffer, seed=1).map(decode)
  elif variant == "indices":
    ds = tf.data.Dataset.range(images).shuffle(buffer, seed=1).map(read)
  else:  # tf.data's global shuffle (TF 2.21: not yet public) needs random access throughout.
    ds = global_shuffle_op._global_shuffle(tf.data.Dataset.range(images).map(read), seed=1)  # pylint: disable=protected-access
  return ds.batch(32, drop_remainder=True).repeat().prefetch(2)


def _measure(variant, args):
  """In this process: fit 10 steps with backups every 5; returns what the newest backup holds."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.format import manifest  # pylint: disable=g-import-not-at-top
  ds = _pipeline(variant, args.images, args.side, args.buffer)
  model = keras.Sequential([keras.Input((args.side, args.side, 3)),
                            keras.layers.Conv2D(8, 3, strides=2), keras.layers.GlobalAveragePooling2D(),
                            keras.layers.Dense(10)])
  model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  folder = tempfile.mkdtemp(prefix="tfdp-dp-size-")

  class Blocked(keras.callbacks.Callback):
    """The time from step 5's end to step 6's begin: its backup (which runs after the other callbacks)."""

    def __init__(self):
      super().__init__()
      self.seconds, self._t = None, None

    def on_train_batch_end(self, batch, logs=None):
      self._t = time.perf_counter() if batch == 4 else None

    def on_train_batch_begin(self, batch, logs=None):
      if self._t is not None:
        self.seconds = time.perf_counter() - self._t

  blocked = Blocked()
  model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0, callbacks=[
      blocked, tfdp.callbacks.BackupAndRestore(folder, save_freq=5, delete_checkpoint=False)])
  man = manifest.read_manifest(os.path.join(folder, "ckpt-10"))
  per_worker = sum(int(w.get("per_worker_bytes", 0)) for w in man.writers.values())
  return {"variant": variant, "per_worker_bytes": per_worker, "total_bytes": man.total_bytes,
          "save_seconds": blocked.seconds}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--images", type=int, default=10_000)
  parser.add_argument("--side", type=int, default=32)
  parser.add_argument("--buffer", type=int, default=10_000)
  parser.add_argument("--variant", choices=VARIANTS, help="internal: measure one, print JSON")
  args = parser.parse_args()
  if args.variant:
    print("RESULT " + json.dumps(_measure(args.variant, args)), flush=True)
    return
  print(f"{args.images} PNG images of {args.side}x{args.side}x3, decoded to float32; "
        f"B = {args.buffer}; batch(32), prefetch(2)")
  print(f"{'pipeline':46} {'data position':>14} {'of the backup':>14} {'a save blocked':>15}")
  for variant in VARIANTS:  # one process each: each starts TensorFlow afresh
    out = subprocess.run([sys.executable, __file__, f"--variant={variant}", f"--images={args.images}",
                          f"--side={args.side}", f"--buffer={args.buffer}"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).stdout
    r = json.loads(out.split("RESULT ", 1)[1])
    print(f"{TITLES[variant]:46} {r['per_worker_bytes'] / 1e6:11.2f} MB "
          f"{r['per_worker_bytes'] / r['total_bytes']:13.1%} {1e3 * r['save_seconds']:12.0f} ms")


if __name__ == "__main__":
  main()
