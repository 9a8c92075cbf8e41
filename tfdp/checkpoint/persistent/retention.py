"""Which checkpoints to keep: small pure policies (no I/O) and the sweep that applies them."""

import collections
import dataclasses
from typing import Protocol, Sequence

from tfdp import errors

# What a policy sees of one committed checkpoint.
Entry = collections.namedtuple("Entry", ["prefix", "number", "time", "metrics"])


class KeepPolicy(Protocol):
  def keeps(self, entries: Sequence[Entry]) -> set[str]:
    """Prefixes of `entries` this policy keeps in the managed set."""


@dataclasses.dataclass(frozen=True)
class KeepLatest:
  """The newest `n` (all when n is None), as `max_to_keep`."""
  n: int | None

  def __post_init__(self):
    if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int)
                               or self.n < 1):
      raise errors.ConfigError(
          f"max_to_keep={self.n!r}: pass an int >= 1 or None (keep all).")

  def keeps(self, entries: Sequence[Entry]) -> set[str]:
    entries = sorted(entries, key=lambda e: e.number)
    if self.n is None:
      return {e.prefix for e in entries}
    return {e.prefix for e in entries[max(0, len(entries) - self.n):]}


@dataclasses.dataclass(frozen=True)
class KeepBest:
  """The `k` with the best `metric` passed to save(metrics=...): mode "min" or "max".

  E.g. `KeepBest("val_loss", "min", 3)`; a plain tuple works too.
  """
  metric: str
  mode: str
  k: int

  def __post_init__(self):
    if self.mode not in ("min", "max") or not isinstance(self.k, int) or self.k < 1:
      raise errors.ConfigError(
          f"keep_best={tuple(self)!r}: mode must be 'min' or 'max' and k an int >= 1.")

  def __iter__(self):
    return iter((self.metric, self.mode, self.k))

  def keeps(self, entries: Sequence[Entry]) -> set[str]:
    scored = [e for e in entries if e.metrics and self.metric in e.metrics]
    sign = 1.0 if self.mode == "min" else -1.0
    scored.sort(key=lambda e: (sign * e.metrics[self.metric], -e.number))
    return {e.prefix for e in scored[:self.k]}


def parse_keep_best(best) -> KeepBest:
  """`keep_best` as a KeepBest: (metric, mode, k), a KeepBest, or the string "metric:mode:k".

  Raises:
    ConfigError: anything else, e.g. a mode other than min/max or k < 1.
  """
  if isinstance(best, str):
    parts = best.split(":")
    if len(parts) != 3 or not parts[0] or parts[1] not in ("min", "max") or not (
        parts[2].isdigit() and int(parts[2]) >= 1):
      raise errors.ConfigError(
          f"keep_best={best!r}: pass METRIC:min|max:K, e.g. val_loss:min:3.")
    return KeepBest(parts[0], parts[1], int(parts[2]))
  try:
    metric, mode, k = best
  except (TypeError, ValueError):
    raise errors.ConfigError(
        f"keep_best={best!r}: pass (metric, 'min'|'max', k), e.g. "
        "('val_loss', 'min', 3), or 'val_loss:min:3'.") from None
  return KeepBest(str(metric), mode, k)


def policies(max_to_keep, keep_best, hours) -> tuple["AnyOf", "KeepEveryNHours"]:
  """A manager's retention: (what stays managed, what of the rest is preserved).

  Args:
    max_to_keep: keep the newest N (None: all).
    keep_best: also keep the best K by a metric (see parse_keep_best), or None.
    hours: `keep_checkpoint_every_n_hours`, or None.
  """
  keep = [KeepLatest(max_to_keep)] + ([parse_keep_best(keep_best)] if keep_best is not None
                                      else [])
  return AnyOf(tuple(keep)), KeepEveryNHours(hours)


@dataclasses.dataclass(frozen=True)
class AnyOf:
  """Keeps what any of `policies` keeps."""
  policies: Sequence[KeepPolicy]

  def keeps(self, entries: Sequence[Entry]) -> set[str]:
    kept = set()
    for p in self.policies:
      kept |= p.keeps(entries)
    return kept


@dataclasses.dataclass(frozen=True)
class KeepEveryNHours:
  """`keep_checkpoint_every_n_hours`: a checkpoint leaving the managed set is
  preserved (never deleted, no longer listed) when it is at least `hours`
  newer than the last one preserved, as in tf.train.CheckpointManager."""
  hours: float | None

  def preserves(self, entry: Entry, last_preserved: float) -> bool:
    return (self.hours is not None and
            entry.time - self.hours * 3600.0 >= last_preserved)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """The outcome of a retention decision."""
  kept: tuple[Entry, ...]  # Still managed (listed in `checkpoints`), oldest first.
  preserved: tuple[Entry, ...]  # Kept on disk, no longer managed.
  deleted: tuple[Entry, ...]
  last_preserved: float


def sweep(entries: Sequence[Entry], keep: KeepPolicy, hours: KeepEveryNHours,
          last_preserved: float) -> Sweep:
  """Applies `keep`, then `hours` to what `keep` lets go, oldest first.

  The newest entry is always kept: it is the last checkpoint known intact.

  Args:
    entries: every managed checkpoint, including the new one.
    keep: what stays managed.
    hours: what is preserved of the rest.
    last_preserved: time of the last preserved checkpoint (TF's
      `last_preserved_timestamp`).

  Returns:
    The Sweep.
  """
  entries = sorted(entries, key=lambda e: e.number)
  if not entries:
    return Sweep((), (), (), last_preserved)
  stays = keep.keeps(entries) | {entries[-1].prefix}
  kept, preserved, deleted = [], [], []
  for e in entries:
    if e.prefix in stays:
      kept.append(e)
    elif hours.preserves(e, last_preserved):
      preserved.append(e)
      last_preserved = e.time
    else:
      deleted.append(e)
  return Sweep(tuple(kept), tuple(preserved), tuple(deleted), last_preserved)
