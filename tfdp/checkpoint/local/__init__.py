"""The local tier: each worker's whole copies in host memory (raw slot files), replicated to a peer.

Owns:
- tier.py: the tier (a writer thread, slot choice, replication, receive and adopt, recovery markers);
- face.py: its face on the manager; cadence.py: how often it saves;
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
May import: tfdp.checkpoint.format, tfdp.checkpoint.persistent, tfdp.distribute, tfdp.errors.
"""
