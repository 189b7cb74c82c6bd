"""One line per file: the sha256 of every tensor a saved state holds (``model.pt``, a
``hiso rebuild --out`` file, ``checkpoint.pt``: its state, so it matches ``hiso rebuild --round``
at its round), names flattened, bytes on the CPU.

    python bench/state_digest.py RUN/model.pt /tmp/rebuilt.pt

Two files print the same digest exactly when their tensors are bit for bit equal, whatever the
device that wrote them or the archive's layout: how a run made on a GPU is checked against its
rebuild on a CPU when the model itself is too large to carry back (bench/gpu.md).
"""

from __future__ import annotations

import sys


def flat(state, prefix: str = "") -> dict:
    import torch

    out = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, name + "."))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


def digest(path: str) -> tuple[str, int]:
    import torch

    from hiso.tasks.lm import fingerprint

    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state.get("state"), dict) and "format" in state:  # checkpoint.pt: the replica's state_dict inside
        state = state["state"]
    tensors = flat(state)  # the model, H and every other slot; "base" holds names only
    return fingerprint(tensors), sum(t.numel() for t in tensors.values())


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/state_digest.py FILE [FILE ...]")
    for path in sys.argv[1:]:
        d, n = digest(path)
        print(f"{d}  {n} numbers  {path}")


if __name__ == "__main__":
    main()
