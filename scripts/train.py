"""Train a model with tfdp: `python scripts/train.py --model=cnn ...` (same as `tfdp-train`)."""

from tfdp.cli import train

if __name__ == "__main__":
  train.run()
