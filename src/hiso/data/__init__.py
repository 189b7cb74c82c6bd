"""Datasets and client partitions for the federated tasks.

Loaders live in :mod:`hiso.data.vision`, partitioners in :mod:`hiso.data.partition`. Both are
plain numpy/torch so the package has no dependency on torchvision or Hugging Face ``datasets``.
"""

from __future__ import annotations


class DataError(ValueError):
    """A dataset file is missing, truncated or not what its name claims.

    A ``ValueError`` so callers that validate configuration can treat it like any bad input;
    the message always names the offending file and says how to obtain the data.
    """


__all__ = ["DataError"]
