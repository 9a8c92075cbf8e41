"""Who this process is in the job, and the strategy it trains under.

Owns: the cluster identity and its one small agreement (cluster.py), what the
environment says (TF_CONFIG, SLURM: environment.py), the strategy kinds
(kinds.py, no TensorFlow), `make_strategy` (strategy.py), a multi-worker
start-up that waits for its peers (startup.py).
May import: tfdp.gradients, tfdp.errors.
"""
