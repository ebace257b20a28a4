"""The reconfiguration protocol: world plans, store keys, and the job's c10d store."""
