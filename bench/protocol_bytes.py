"""Per-client bytes of a schedule under the current protocol, from the encoded messages.

    PYTHONPATH=src python bench/protocol_bytes.py

The bytes of a scalar-only run do not depend on what it learns, only on the schedule (who is
sampled when) and the model's size (snapshots), so this counts exactly what a run of the
schedule counts (tests/test_messages.py checks that against a simulated run), in seconds.
"""

from hiso.runners.simulate import protocol_traffic

# (name, clients, sampled, tau, P, rounds, trainable values + H values (None: never a snapshot))
SCHEDULES = [
    ("paper: DeComFL OPT-350M SST-2 (paper: 21.56 KB)", 6, 2, 1, 5, 550, None),
    ("MNIST main job (configs/mnist_main.toml), HiSo", 64, 8, 1, 5, 400, 2 * 28_938),
    ("full MNIST, 500 rounds (docs/results.md), HiSo", 64, 8, 1, 5, 500, 2 * 28_938),
]

if __name__ == "__main__":
    print("| schedule | scalars | up / client | down / client | total / client (mean) | max client |")
    print("|---|---|---:|---:|---:|---:|")
    for name, M, m, tau, P, R, values in SCHEDULES:
        for dtype in ("float32", "float16"):
            s = protocol_traffic(M, m, tau, P, R, scalar_dtype=dtype, seed=0, state_values=values).summary()
            print(f"| {name} | {dtype} | {s['bytes_up_mean'] / 1e3:.2f} KB | {s['bytes_down_mean'] / 1e3:.2f} KB | "
                  f"{s['bytes_total_mean'] / 1e3:.2f} KB | {s['bytes_total_max'] / 1e3:.2f} KB |")
