"""hiso on Flower: a ServerApp/ClientApp over the core (:mod:`hiso.flower.app`), a node's
memory-mapped replica (:mod:`hiso.flower.replica`), a local launcher for a SuperLink and
SuperNodes (:mod:`hiso.flower.launch`) and the simulation engine (:mod:`hiso.flower.sim`).

Needs the ``flower`` extra: ``pip install -e '.[flower]'``. See docs/flower.md.
"""
