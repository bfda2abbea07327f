"""elasticd: node daemon for elastic, fault-tolerant PyTorch training."""
__version__ = "0.1.0"
