"""Who this process is in the job, and the strategy it trains under.

Owns:
- cluster.py: the cluster identity and its one small agreement;
- environment.py: what the environment says (TF_CONFIG, SLURM);
- kinds.py: the strategy kinds and their choice (no TensorFlow);
- strategy.py: `make_strategy`;
- startup.py: a multi-worker start-up that waits for its peers.
May import: tfdp.gradients, tfdp.errors.
"""
