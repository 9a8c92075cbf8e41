"""ft_fit.py's plain fit, undisturbed but for a stranger holding every slot of both workers' side channels while it trains.

Usage: ft_trickle.py OUT_ROOT (under tfdp-launch, 2 workers; env as
ft_fit.py's). Once worker 0's side channel is up, before the first local
save (so every first connection between the workers comes while the
stranger holds the slots), its thread (ft_stranger.Trickle) holds
max_connections(2) connections on each worker, each sending a byte a
second and opened again as soon as the server cuts it, to the end of
training. Prints "ft_fit: ..." lines: each worker's newest step complete
everywhere and the per-worker states it keeps at the end, worker 0's
stranger's counts.
"""

import json

import ft_fit  # tests/workers/
import ft_stranger  # tests/workers/


def _wrap_train():
  from tfdp.callbacks import backup as backup_lib  # pylint: disable=g-import-not-at-top
  from tfdp.checkpoint.local import peers  # pylint: disable=g-import-not-at-top
  begin, end = backup_lib.BackupAndRestore.on_train_begin, backup_lib.BackupAndRestore.on_train_end
  held = {}

  def on_train_begin(self, logs=None):
    begin(self, logs)
    link = self.manager._local.link  # pylint: disable=protected-access
    if ft_fit.ME == 0:
      held["trickle"] = ft_stranger.Trickle(link._sends.peers, peers.max_connections(2))  # pylint: disable=protected-access

  def on_train_end(self, logs=None):
    tier = self.manager._local  # pylint: disable=protected-access
    self.manager.sync()
    report = {"floor": tier.generations.floor, "kept": tier.kept_for_left(),
              "refused": tier.link.refusals.count}
    if "trickle" in held:
      trickle = held.pop("trickle")
      trickle.stop()
      report.update(longest=round(trickle.longest, 2), opened=trickle.opened,
                    held_s=round(trickle.seconds, 1))
    ft_fit.say(f"trickled: {json.dumps(report)}")
    end(self, logs)

  backup_lib.BackupAndRestore.on_train_begin = on_train_begin
  backup_lib.BackupAndRestore.on_train_end = on_train_end


def main():
  faults = ft_fit._faults  # pylint: disable=protected-access

  def faults_then_trickle():  # ft_fit.main wraps the callback first; this wraps its wrapper.
    faults()
    _wrap_train()

  ft_fit._faults = faults_then_trickle  # pylint: disable=protected-access
  ft_fit.main()


if __name__ == "__main__":
  main()
