"""The built-in trainer's synthetic data set (hetero/trainer/data.py): drawn in place, it is bit for bit the plain
expression each class prototype plus noise, so no run's data changed when its drawing got cheaper."""
import torch

from hetero.trainer import data


def _plain(n_train: int, n_test: int, n_classes: int = 10) -> tuple:
    g = torch.Generator().manual_seed(1234)
    protos = torch.nn.functional.interpolate(torch.rand(n_classes, 3, 4, 4, generator=g), size=data.IMAGE_SIZE,
                                             mode="bilinear", align_corners=False)

    def draw(n):
        y = torch.randint(0, n_classes, (n,), generator=g)
        x = 64 + 128 * protos[y] + 120 * torch.randn(n, 3, data.IMAGE_SIZE, data.IMAGE_SIZE, generator=g)
        return x.clamp(0, 255).to(torch.uint8), y

    return (*draw(n_train), *draw(n_test))


def test_the_synthetic_set_is_the_plain_expression_bit_for_bit():
    got, want = data._synthetic(3000, 500)[:4], _plain(3000, 500)
    assert [t.dtype for t in got] == [torch.uint8, torch.int64] * 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert 0 < int((got[0] == 0).sum()) and 0 < int((got[0] == 255).sum())  # the clamp bites at both ends
