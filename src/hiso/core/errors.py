"""The errors a decoder raises (here, below :mod:`hiso.core.wire` and :mod:`hiso.core.scalars`, which both raise them)."""


class MessageError(ValueError):
    """A message that cannot be decoded or does not fit the receiver's state. ``code``: the
    reason a round counts it under (a subclass names its own)."""

    code = "malformed"


class JoinError(MessageError):
    """A peer that must not join this run (another protocol, configuration or x_0)."""
