"""A plain Keras `fit` on a TFRecord pipeline (data_resume.py's "data" mode) under a plan of faults, one per attempt.

Usage: ft_fit.py OUT_ROOT (under tfdp-launch --max_restarts). Env:
- FT_PLAN: JSON {attempt: event} (attempt: TFDP_RESTART_COUNT). Events:
  {"worker": w, "step": s, "wipe": "own"}: worker w SIGKILLs itself at the
  end of the first step >= s (after the callbacks), having deleted its local tier first
  with "wipe" (a replaced host); {"attack": s}: worker 0 mounts the
  stranger's attacks on both side channels at step s (ft_stranger.py, and
  malformed frames on an authenticated connection), worker 1 then checks
  its tier; {"read_error": w, "ckpt": n}: restoring persistent ckpt-n
  raises a transient read error on worker w.
- FT_HOLDER_KILL_FROM=a: from attempt a on, a worker SIGKILLs itself in
  every peer transfer it sends, once half of the copy's bytes are out
  (its `Channel.send_file` wrapped: tests/workers/local_faults.py).
- FT_SAVE_FREQ (default 100), FT_LOCAL_EVERY (default 2): the tiers (3
  persistent checkpoints kept).
- FT_NONDETERMINISTIC=1: op determinism off, and after every step both
  workers add the same tiny number, different in each attempt, to a
  weight: a step computed twice gives other bits, as GPU kernels do.
A kill waits (at most 20 s) until the local save before the worker's
newest is complete on every worker, unless FT_KILL_AT_ONCE=1 (the issue's
replaced host: no wait, nothing synced). Prints "ft_fit: ..." lines: each kill
with the worker's newest local save and the newest step complete everywhere,
the attack's report, each attempt's restored step.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time

import data_resume  # tests/workers/

OUT = sys.argv[1]
ATTEMPT = int(os.environ.get("TFDP_RESTART_COUNT", "0"))
ME = int(os.environ.get("TFDP_WORKER_INDEX", "0"))
PLAN = json.loads(os.environ.get("FT_PLAN") or "{}")
EVENT = PLAN.get(str(ATTEMPT), {})


def say(msg):
  print(f"ft_fit: attempt {ATTEMPT} worker {ME}: {msg}", flush=True)


def _local_dir(backup):
  return backup.manager.local_directory


def _attack(backup):
  """Worker 0: the stranger's attacks (another process) and malformed frames of an authenticated peer."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import ft_stranger  # pylint: disable=g-import-not-at-top
  link = backup.manager._local.link  # pylint: disable=protected-access
  folder = os.path.join(OUT, "attack")
  os.makedirs(folder, exist_ok=True)
  targets = [f"{h}:{p}" for h, p in link._sends.peers]  # pylint: disable=protected-access
  proc = subprocess.run([sys.executable, ft_stranger.__file__, os.path.join(folder, "stranger.json"),
                         os.path.join(OUT, "escaped")] + targets, timeout=120, check=False,
                        capture_output=True, text=True)
  say(f"stranger exited {proc.returncode} {proc.stderr[-2000:]}")
  insider = ft_stranger.insider_frames(lambda: link._connect(1), os.path.join(OUT, "escaped"))  # pylint: disable=protected-access
  with open(os.path.join(folder, "insider.json"), "w", encoding="utf-8") as f:
    json.dump(insider, f)
  open(os.path.join(folder, "done"), "w").close()
  say(f"attacked {targets}")


def _check_tier(backup, step):
  """Worker 1, once the attacks are done: its tier holds only what the job saved."""
  found = []
  for folder, _, files in os.walk(_local_dir(backup)):
    found += [os.path.relpath(os.path.join(folder, f), _local_dir(backup)) for f in files]
  report = {"step": step, "files": sorted(found), "threads": threading.active_count(),
            "refused": backup.manager._local.link.refusals.count}  # pylint: disable=protected-access
  with open(os.path.join(OUT, "attack", "check.json"), "w", encoding="utf-8") as f:
    json.dump(report, f)
  say(f"checked its tier after the attacks: {report}")


def _wrap_batch_end():
  from tfdp.callbacks import backup as backup_lib  # pylint: disable=g-import-not-at-top
  original = backup_lib.BackupAndRestore.on_train_batch_end
  state = {"checked": False}
  noisy = os.environ.get("FT_NONDETERMINISTIC") == "1"

  def on_train_batch_end(self, batch, logs=None):
    step = int(self.model.optimizer.iterations.numpy())
    if noisy:  # The same on both workers, other in each attempt.
      kernel = self.model.trainable_variables[0]
      kernel.assign_add(kernel * 0.0 + (ATTEMPT + 1) * 1e-6)
    original(self, batch, logs)
    if EVENT.get("attack") == step and ME == 0:
      _attack(self)
    if ME == 1 and "attack" in EVENT and not state["checked"] and os.path.exists(
        os.path.join(OUT, "attack", "done")):
      state["checked"] = True
      self.manager.sync()
      _check_tier(self, step)
    if EVENT.get("worker") == ME and step >= EVENT.get("step", 1 << 60):
      at_once = os.environ.get("FT_KILL_AT_ONCE") == "1"
      if not at_once:
        self.manager.sync()  # What this worker saved locally is written.
      saved = [int(p.rsplit("-", 1)[1]) for p in self.manager.local_checkpoints()]
      # The kill comes once the save before the last is complete everywhere
      # (what the tier then must keep), or 20 s on.
      tier, every = self.manager._local, self.manager.local_interval  # pylint: disable=protected-access
      deadline = time.monotonic() + (0 if at_once else 20)
      while saved and (tier.generations.floor or -1) < max(saved) - every and (
          time.monotonic() < deadline):
        time.sleep(0.01)
      if EVENT.get("wipe") == "own":
        shutil.rmtree(_local_dir(self), ignore_errors=True)
      costs = [f"{1e3 * (b + w):.0f}" for b, w in self.manager._local.costs[-4:]]  # pylint: disable=protected-access
      say(f"SIGKILL at step {step}, last local save {max(saved) if saved else None} (of {saved}), "
          f"complete everywhere {tier.generations.floor}, "
          f"wiped {EVENT.get('wipe')}, {self.manager.local_saves_skipped} local saves skipped "
          f"(the last cost {costs} ms)")
      os.kill(os.getpid(), signal.SIGKILL)

  backup_lib.BackupAndRestore.on_train_batch_end = on_train_batch_end

  def on_train_begin(self, logs=None):
    original_begin(self, logs)
    say(f"restored {self.restored_step} from the {self.manager.restored_tier} tier")

  original_begin = backup_lib.BackupAndRestore.on_train_begin
  backup_lib.BackupAndRestore.on_train_begin = on_train_begin
  # The tiers of this job (data_resume.py saves every 3 steps).
  original_init = backup_lib.BackupAndRestore.__init__

  def init(self, backup_dir, save_freq="epoch", *args, **kwargs):
    kwargs["local_checkpoint_every_steps"] = int(os.environ.get("FT_LOCAL_EVERY", "2"))
    kwargs["max_to_keep"] = 3
    original_init(self, backup_dir, int(os.environ.get("FT_SAVE_FREQ", "100")), *args, **kwargs)

  backup_lib.BackupAndRestore.__init__ = init


def _faults():
  start = os.environ.get("FT_HOLDER_KILL_FROM")
  if start is not None and ATTEMPT >= int(start):
    import local_faults  # pylint: disable=g-import-not-at-top  (tests/workers/)
    from tfdp.checkpoint.local import channel  # pylint: disable=g-import-not-at-top

    def kill():
      say("SIGKILL during a peer transfer it sends")
      os.kill(os.getpid(), signal.SIGKILL)

    # Half of the copy's bytes go out, then this process dies (only a holder sends copies).
    channel.Channel.send_file = local_faults.half_then(kill)
  if EVENT.get("read_error") == ME:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdp.checkpoint import restore  # pylint: disable=g-import-not-at-top
    real, name = restore.restore_verified, f"ckpt-{EVENT['ckpt']}"

    def flaky(checkpoint, prefix, man):
      if os.path.basename(prefix) == name and "worker-" not in prefix:
        say(f"a transient read error on {name}")
        raise tf.errors.UnavailableError(None, None, f"injected: {name} cannot be read now")
      return real(checkpoint, prefix, man)

    restore.restore_verified = flaky


def main():
  _wrap_batch_end()
  _faults()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdp  # pylint: disable=g-import-not-at-top
  strategy = tfdp.make_strategy()
  if os.environ.get("FT_NONDETERMINISTIC") != "1":
    tf.config.experimental.enable_op_determinism()
  worker = tfdp.cluster.resolve(strategy).index
  data_resume.train(os.path.join(OUT, "data"), "data", strategy, worker)
  # The manager closed its side channel: no thread of it is left.
  left = [t.name for t in threading.enumerate() if t.name.startswith("tfdp-peer")]
  say(f"finished; side-channel threads left: {left}")


if __name__ == "__main__":
  main()
