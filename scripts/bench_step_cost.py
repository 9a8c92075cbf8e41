"""Where a saving step's time goes (issue 45): the issue's user script, one variant per process.

python step_cost.py VARIANT THREADS STEPS -> one JSON line: steps/s after step 100, callback ms/step, writer CPU.
VARIANT: never | every1 | every5 | auto | every1_gilfree | every1_nowrite | every1_nocrc
THREADS: 1 (a free core: training confined to one thread) or 0 (TF's default, both cores busy).
"""
import json, os, sys, time
variant, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import numpy as np
import tensorflow as tf
if threads:
  tf.config.threading.set_intra_op_parallelism_threads(threads)
  tf.config.threading.set_inter_op_parallelism_threads(threads)
import keras
import tfdp

strategy = tfdp.make_strategy(cpu_replicas=2)
from tfdp.checkpoint.local import slots, tier as tier_lib
from tfdp.callbacks import backup as backup_lib

if variant.endswith("_gilfree") or variant.endswith("_nocrc"):
  import crc32c
  class _Shim:
    @staticmethod
    def extend(crc, buf):
      return 0 if variant.endswith("_nocrc") else crc32c.crc32c(buf, value=crc)
  slots.google_crc32c = _Shim
if variant.endswith("_nowrite"):
  tier_lib.LocalTier._write = lambda self, *a, **k: None

cb_time = [0.0]
real_end = backup_lib.BackupAndRestore.on_train_batch_end
def timed_end(self, batch, logs=None):
  t = time.perf_counter(); out = real_end(self, batch, logs); cb_time[0] += time.perf_counter() - t
  return out
backup_lib.BackupAndRestore.on_train_batch_end = timed_end

N = 2048
x = np.random.default_rng(0).normal(size=(N, 512)).astype("float32")
y = np.random.default_rng(1).integers(0, 10, N)
ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048).repeat().batch(64)
with strategy.scope():
  # 512*2048 + 2048*1024 + 1024*10 floats ~ 3.1 M params = 12.6 MB; Adam's two slots triple the state (~38 MB)
  # -> the issue's "16 MB model and Adam state": 1.4 M params x 3 = 16.8 MB.
  model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                            keras.layers.Dense(856, activation="relu"), keras.layers.Dense(10)])
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
every = {"never": None, "every5": 5, "auto": "auto", "async50": None}.get(variant, 1)
root = f"/tmp/b45/{variant}-{threads}-{os.getpid()}"
kw = dict(save_freq=50, async_save=True) if variant == "async50" else dict(save_freq=False)
if every is not None:
  kw.update(local_checkpoint_every_steps=every)
cb = tfdp.callbacks.BackupAndRestore(root + "/backup", **kw)
stamps = []
class Stamp(keras.callbacks.Callback):
  def on_train_batch_end(self, batch, logs=None):
    stamps.append(time.perf_counter())
t0 = time.process_time()
model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[cb, Stamp()])
cpu = time.process_time() - t0
st = stamps[100:]
rate = (len(st) - 1) / (st[-1] - st[0])
params = sum(int(np.prod(v.shape)) for v in model.weights)
print(json.dumps({"variant": variant, "threads": threads, "steps_per_s": round(rate, 2),
                  "callback_ms_per_step": round(1000 * cb_time[0] / len(stamps), 3),
                  "process_cpu_s": round(cpu, 2), "wall_s": round(stamps[-1] - stamps[0], 2),
                  "state_mb": round(params * 4 * 3 / 1e6, 1)}), flush=True)
