"""The local tier: each worker's whole copies in host memory (raw slot files), replicated to a peer.

Owns: the tier (tier.py) and its face on the manager (face.py), how often it
saves (cadence.py), slot files (slots.py, bundle.py, slot_choice.py), one copy
on disk (copies.py), which copies to keep (generations.py), the side channel
(peers.py, channel.py, wire.py), a neighbour's per-worker states
(replicas.py), the restore's phase timers (phases.py).
May import: tfdp.checkpoint.format, tfdp.checkpoint.persistent, tfdp.distribute, tfdp.errors.
"""
