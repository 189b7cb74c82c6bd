"""hiso's version, in a module of its own: what writes it into a file (an export's metadata, a
packed model's manifest) imports it from here, below every layer."""

__version__ = "0.1.0"
