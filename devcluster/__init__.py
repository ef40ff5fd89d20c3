"""The dockerized Slurm test cluster: image build, up/down, and the e2e harness.

Developer tooling only: imports the docker SDK, so nothing on the node side imports this.
"""
