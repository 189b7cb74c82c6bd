"""MNIST CNN forward with hiso's MaxPool2 against nn.MaxPool2d, interleaved in one process (A B B A ...).

    python bench/cnn_pooling.py          # one thread, batch 32, median of 6 blocks of 100 forwards
"""
import torch, time
torch.set_num_threads(1)
from hiso.tasks.vision import MnistCNN
torch.manual_seed(0)
fast = MnistCNN(); slow = MnistCNN(); slow.load_state_dict(fast.state_dict())
for seq in (slow.conv1, slow.conv2): seq[2] = torch.nn.MaxPool2d(2)
x = torch.randn(32, 1, 28, 28)
res = {"fast": [], "slow": []}
with torch.no_grad():
    for rep in range(6):
        for name, m in (("slow", slow), ("fast", fast)) if rep % 2 else (("fast", fast), ("slow", slow)):
            t = time.perf_counter()
            for _ in range(100): m(x)
            res[name].append((time.perf_counter() - t) / 100 * 1e3)
import statistics as st
f, s = st.median(res["fast"]), st.median(res["slow"])
print(f"forward of 32 images, 1 thread: nn.MaxPool2d {s:.2f} ms, MaxPool2 {f:.2f} ms, ratio {f/s:.2f}")
