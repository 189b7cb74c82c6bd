"""hiso: federated zeroth-order fine-tuning with scalar-only communication (HiSo, DeComFL)."""

__version__ = "0.1.0"
