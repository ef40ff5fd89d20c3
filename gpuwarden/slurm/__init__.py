"""Talking to Slurm: a typed client over its JSON CLIs, pure parsers, hostlists, drain rules."""
