"""tfdp-train's pieces, each a public piece a user could wire by hand.

Owns: one training run from a config (trainer.py), optimizers and schedules
(optim.py), TensorBoard, evaluation and the end-of-run summary
(summaries.py), export to plain Keras and Hugging Face files (export.py,
safetensors.py).
May import: every sub-package of tfdp except tfdp.cli and tfdp.launch.
"""
