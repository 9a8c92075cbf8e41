"""A job that never hangs: preemption, heartbeats, and steps stuck in a collective.

Owns:
- preemption.py: the agreed save-and-exit on SIGTERM;
- heartbeat.py: per-batch heartbeats and the prompt exit naming a lost peer;
- stall.py: aborting a stuck collective, one line and exit 70.
May import: tfdp.distribute, tfdp.errors.
"""
