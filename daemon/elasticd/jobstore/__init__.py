"""The per-job store the daemon hosts for ``--inprocess`` jobs, and how ranks find it."""
