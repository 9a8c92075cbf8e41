"""tfdp-train's pieces, each a public piece a user could wire by hand.

Owns:
- trainer.py: one training run from a config;
- optim.py: optimizers and learning-rate schedules;
- summaries.py: periodic evaluation, the end-of-run summary (`tfdp.summaries`);
- tensorboard.py: TensorBoard keyed by the global step;
- timings.py: the wall time a run spends outside its steps (evaluation, checkpoints);
- export.py: export to plain Keras files, a model rebuilt from a checkpoint (`tfdp.export`);
- safetensors.py: a checkpoint's tensors as Hugging Face safetensors files.
May import: tfdp.callbacks, tfdp.checkpoint, tfdp.resume, tfdp.data,
tfdp.datasets, tfdp.distribute, tfdp.gradients, tfdp.liveness, tfdp.errors.
"""
