"""A job that never hangs: preemption, heartbeats, and steps stuck in a collective.

Owns: the agreed save-and-exit on SIGTERM (preemption.py), per-batch
heartbeats and the prompt exit naming a lost peer (heartbeat.py), aborting a
stuck collective (stall.py).
May import: tfdp.distribute, tfdp.errors.
"""
