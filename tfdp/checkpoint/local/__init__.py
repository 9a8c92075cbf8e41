"""The local tier: each worker's whole copies in host memory (raw slot files), replicated to a peer.

Owns:
- tier.py: the tier (saves, slot choice, replication, receive and adopt, garbage collection);
- options.py: LocalOptions, its settings as one value, and the tier built from them;
- save_queue.py: its writer queue (one save at a time, the newest waiting);
- held_copies.py: what its directory holds at start, why a copy cannot be used, the recovery markers;
- slots.py: a slot file written (its tensors copied and checksummed in one pass);
- slot_choice.py: which slot a save or a received copy fills;
- bundle.py: a TF index over a slot, so TensorFlow's own reader reads a copy;
- copies.py: one copy on disk: written and committed, checked, restored, sent, received, deleted;
- generations.py: which steps are complete on every worker, and which copies to keep;
- peers.py: the side channel's link: its server, and what it accepts;
- outbound.py: the link's sends (per-worker states, done reports, a restore's copies);
- awaited.py: the messages a restore waits for on the link;
- channel.py: the link's handshake, authenticated frames, and who holds its connections;
- wire.py: frames and headers, checked (nothing trusts the wire);
- replicas.py: the per-worker states a worker keeps of its neighbour;
- phases.py: PhaseTimes, the seconds a restore spends in each phase.
The slot-file format itself (its reader and checks) is tfdp.checkpoint.format.slot_file.
How often it saves (LocalCadence) and its writer thread are tfdp.checkpoint.schedule's.
May import: tfdp.checkpoint.format, tfdp.checkpoint.schedule, tfdp.distribute, tfdp.errors.
"""
