"""Retention policies: pure functions from committed checkpoints to the ones to keep."""

import collections

from tfdp import errors

# What a policy sees of one committed checkpoint.
Entry = collections.namedtuple("Entry", ["prefix", "number", "time", "metrics"])

# keep_best=KeepBest("val_loss", "min", 3): keep the 3 checkpoints with the
# lowest `val_loss` passed to save(metrics=...). A plain tuple works too.
KeepBest = collections.namedtuple("KeepBest", ["metric", "mode", "k"])


def keep_last(entries, n):
  """The newest `n` entries (all when n is None)."""
  entries = sorted(entries, key=lambda e: e.number)
  if n is None:
    return {e.prefix for e in entries}
  return {e.prefix for e in entries[max(0, len(entries) - n):]} if n > 0 else set()


def keep_every_n_hours(entries, hours):
  """One entry per `hours`: the first, then each at least `hours` after the last kept.

  Stable under deletion of entries it does not keep, so it can be recomputed
  from whatever survives.
  """
  if hours is None:
    return set()
  kept, last = set(), None
  for e in sorted(entries, key=lambda e: (e.time, e.number)):
    if last is None or e.time - last >= hours * 3600.0:
      kept.add(e.prefix)
      last = e.time
  return kept


def keep_best(entries, best):
  """The `k` entries with the best value of `metric` (`mode` "min" or "max")."""
  if best is None:
    return set()
  metric, mode, k = parse_keep_best(best)
  scored = [e for e in entries if e.metrics and metric in e.metrics]
  scored.sort(key=lambda e: (e.metrics[metric] if mode == "min"
                             else -e.metrics[metric], -e.number))
  return {e.prefix for e in scored[:k]}


def parse_keep_best(best):
  """Validates `keep_best` and returns it as a KeepBest."""
  try:
    metric, mode, k = best
  except (TypeError, ValueError):
    raise errors.ConfigError(
        f"keep_best={best!r}: pass (metric, 'min'|'max', k), e.g. "
        "('val_loss', 'min', 3).") from None
  if mode not in ("min", "max") or not isinstance(k, int) or k < 1:
    raise errors.ConfigError(
        f"keep_best={best!r}: mode must be 'min' or 'max' and k an int >= 1.")
  return KeepBest(str(metric), mode, k)


def to_keep(entries, *, max_to_keep, keep_every_n_hours_=None, best=None):
  """Union of the policies; the newest entry is always kept.

  Args:
    entries: every committed checkpoint (Entry), including the new one.
    max_to_keep: keep the newest N (None keeps all).
    keep_every_n_hours_: also keep one per this many hours.
    best: also keep the best K by a metric (see `keep_best`).

  Returns:
    The set of prefixes to keep.
  """
  if not entries:
    return set()
  kept = keep_last(entries, max_to_keep)
  kept |= keep_every_n_hours(entries, keep_every_n_hours_)
  kept |= keep_best(entries, best)
  # Never delete the newest: it is the last checkpoint known intact.
  kept.add(max(entries, key=lambda e: e.number).prefix)
  return kept
