"""The direction kernels: how the numbers of a direction family are produced and combined.

``philox.py`` is the reference (Philox4x32-10 in numpy, checked against Random123's vectors) and
the torch integer-op path (any device); ``philox_numba.py`` and ``families_numba.py`` the fused CPU
kernels; ``philox_triton.py`` the fused CUDA kernels. All give the same bits. The protocol's
definition of a direction, and the one interface the core calls, is
:class:`hiso.core.directions.DirectionGenerator`; nothing here knows about rounds or clients.
"""
