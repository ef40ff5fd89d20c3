"""`gpuwarden install-files`: the Slurm hooks, Lua plugins, checkpoint kit and systemd units,
copied out of the installed package into a site's prefix (docs/admin-guide.md)."""
