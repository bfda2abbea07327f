"""Forming the node group of one job round: protocol (pure), status, round (this node's part), view, torchrun adapter."""
