"""gpuwarden: Slurm plugin suite and site-reliability toolkit for GPU clusters."""

__version__ = "0.1.0"
