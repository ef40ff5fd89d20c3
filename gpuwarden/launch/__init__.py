"""Hot spares inside a Slurm allocation: `gpuwarden launch --spares k -- <training command>`.

The job holds N+k nodes (`#SBATCH --no-kill`); the launcher runs the training as one step on N
of them, watches per-rank heartbeats, and when a node is lost relaunches the step on the
survivors plus a spare, whose rank restores from its partner's replica (the peer tier). Pure
decisions in `decide`; Slurm, the clock and the network behind Protocols (`steps`,
`heartbeat`, `report`), with fakes for tests (`localsteps`).
"""
