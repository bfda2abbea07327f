"""This node among the others: the store and lease, the node list, adopting jobs, shared events."""
