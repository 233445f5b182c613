"""Every model takes 32x32 RGB and returns 10 logits (kuangliu's commented-out shape check, as a test)."""
import pytest
import torch

from hetero.trainer.models import MODELS, build_model


@pytest.mark.parametrize("name", MODELS)
def test_shapes(name):
    torch.manual_seed(0)
    m = build_model(name).eval()
    with torch.no_grad():
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_sizes_are_the_published_ones():
    count = lambda name: sum(p.numel() for p in build_model(name).parameters()) / 1e6
    assert 14.5 < count("vgg16") < 15.5      # CIFAR VGG16: ~14.7 M
    assert 11.0 < count("resnet18") < 11.3   # ~11.2 M
    assert 23.4 < count("resnet50") < 23.6   # ~23.5 M


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("alexnet")
