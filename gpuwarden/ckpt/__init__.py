"""Tiered checkpointing: manifests, verified commits per tier, restore from the fastest tier.

In progress (issue 6): the manifest, the filesystem tiers (node memory and the shared
filesystem) and restore with walk-back are here; peers, S3, background write-back and the
Slurm glue are not yet.
"""
