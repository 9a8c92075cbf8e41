"""Byte counts as people read and write them: 812 B, 27.3 MB, "5GB", "512MiB" (no TensorFlow)."""

import argparse
import re

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
               "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}


def human_bytes(n: float) -> str:
  """Bytes in decimal units, as `parse_size` reads them: 812 B, 1.2 MB."""
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1000 or unit == "TB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000.0


def parse_size(text: str) -> int:
  """"5GB" -> 5*10**9, "512MiB" -> 512*2**20 (Hugging Face conventions).

  Raises:
    argparse.ArgumentTypeError: `text` is not a size (the CLIs' flags parse with it).
  """
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
  if not m or m.group(2).upper() not in _SIZE_UNITS:
    raise argparse.ArgumentTypeError(
        f"bad size {text!r}: use e.g. 5GB, 500MB or 1GiB")
  return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
