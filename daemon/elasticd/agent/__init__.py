"""The per-job restart loop: decide, restart (ladder, policy), record what failed."""
