"""`python -m tfdp.launch`: the same as `tfdp-launch`."""

from tfdp.launch.cli import run

run()
