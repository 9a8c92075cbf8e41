"""tfdp's version: the one place it is written (setup.cfg and the package read it)."""

__version__ = "0.1.0"
