"""MNIST's 2x2 max pooling (hiso.tasks.vision.MaxPool2): torch's values bit for bit without
autograd, torch's own kernel (and its gradient) with it."""

import torch
import torch.nn.functional as F

from hiso.tasks.vision import MaxPool2, MnistCNN


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_the_fast_path_gives_torchs_bits_ties_zeros_and_nans_included():
    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(7, 3, 12, 10, generator=g))  # many zeros: ties
    x[0, 0, :2, :2] = 0.5  # a tie of positive values
    x[1, 2, 4, 4] = float("nan")
    x[2, 1, 0, 0] = -0.0
    with torch.no_grad():
        fast = MaxPool2()(x)
    ref = F.max_pool2d(x, 2)
    assert fast.shape == ref.shape == (7, 3, 6, 5)
    nan = ref.isnan()
    assert nan.sum() == 1 and torch.equal(fast.isnan(), nan)  # a NaN stays a NaN (its payload may differ)
    assert torch.equal(_bits(fast)[~nan], _bits(ref)[~nan])


def test_the_cnns_loss_is_torchs_to_the_bit_and_gradients_use_torchs_kernel():
    torch.manual_seed(0)
    model = MnistCNN()
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    ref = MnistCNN()
    ref.load_state_dict(model.state_dict())
    for seq in (ref.conv1, ref.conv2):
        seq[2] = torch.nn.MaxPool2d(2)
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref(x)))
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_odd_sizes_fall_back_to_torch():
    x = torch.randn(2, 3, 7, 9)
    with torch.no_grad():
        assert torch.equal(MaxPool2()(x), F.max_pool2d(x, 2))
