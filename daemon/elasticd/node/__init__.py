"""The node at the top: its coordinator (which jobs run here, on which slots and GPUs, and
their agents), the daemon that wires every part around it, and the command line."""
