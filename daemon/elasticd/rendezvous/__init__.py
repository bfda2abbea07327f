"""Forming the node group of one job round (see local.py for one node)."""
