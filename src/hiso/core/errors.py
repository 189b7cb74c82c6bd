"""The protocol's errors: below every module that decodes bytes (scalars, wire, messages)."""


class MessageError(ValueError):
    """A message that cannot be decoded or does not fit the receiver's state."""


class JoinError(MessageError):
    """A peer that must not join this run (another protocol, configuration or x_0)."""
