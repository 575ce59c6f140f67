"""plait: distributed training and serving for PyTorch."""

__version__ = "0.1.0"
