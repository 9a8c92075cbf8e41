"""When a save runs, and on which thread: shared by the manager, both tiers and the callbacks.

Owns:
- policy.py: when to act at a step (save, save locally, evaluate, summarize): small
  pure policies, and the one Cadence concept with its variants (every N steps,
  the epoch's end, the local tier's "auto" interval from an overhead budget);
- async_writer.py: the one background thread a tier's writes run on, whose errors
  surface exactly once.
May import: tfdp.distribute, tfdp.errors.
"""
