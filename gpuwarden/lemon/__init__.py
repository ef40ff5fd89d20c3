"""Lemon nodes: attributing job failures to nodes from Slurm's accounting, and scoring them."""
