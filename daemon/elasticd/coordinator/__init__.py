"""The node's coordinator: which jobs run here, on which slots and GPUs, and their agents."""
