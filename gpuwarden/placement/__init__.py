"""Gang-aware topology placement: topology, policy, the snapshot the job_submit filter reads."""
