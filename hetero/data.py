"""Data sets held as uint8 tensors [N, 3, 32, 32], and a loader that augments index batches on the device.

Holding the whole (CIFAR-scale) set as one tensor lets a rank take any index slice of the shared permutation
at any step, with no DataLoader to rebuild when batch sizes change; on a GPU the set lives on the device.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .seeding import SUBSET, epoch_seed

IMAGE_SIZE = 32
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 10_000, 2_000


class DataError(RuntimeError):
    """The data set cannot be had: reported as one line, exit status 2."""


@dataclass
class DataSet:
    train_x: torch.Tensor   # uint8 [N, 3, H, W]
    train_y: torch.Tensor   # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: list[str]
    mean: tuple[float, ...]  # per channel, in [0, 1], of the training images
    std: tuple[float, ...]


@contextlib.contextmanager
def _locked(path: Path):
    """Ranks on one host take turns, so one downloads or decodes while the others wait and then read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cifar10(root: Path) -> tuple:
    from torchvision.datasets import CIFAR10

    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data folder {root}: {e.strerror}") from None
    with _locked(root / ".hetero.lock"):
        try:
            train, test = CIFAR10(str(root), train=True), CIFAR10(str(root), train=False)
        except RuntimeError:  # not there yet: torchvision downloads and checks it
            try:
                train = CIFAR10(str(root), train=True, download=True)
                test = CIFAR10(str(root), train=False, download=True)
            except Exception as e:  # offline: URLError, socket errors, ...
                raise DataError(
                    f"CIFAR-10 is not in {root} and could not be downloaded ({type(e).__name__}: {e}). "
                    f"Fix: run once with internet access, or put cifar-10-python.tar.gz (or its extracted "
                    f"cifar-10-batches-py/) into {root}, or use --data imagefolder --data-dir PATH") from None
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))  # NHWC -> NCHW
    return (as_t(train.data), torch.tensor(train.targets), as_t(test.data), torch.tensor(test.targets),
            list(train.classes))


def _decode_folder(folder: Path, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(folder))
    if ds.classes != classes:
        raise DataError(f"{folder} has classes {ds.classes}, expected {classes} as in the train folder")
    x = np.empty((len(ds.samples), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for i, (path, _) in enumerate(ds.samples):
        with Image.open(path) as im:
            im = im.convert("RGB")
            if im.size != (IMAGE_SIZE, IMAGE_SIZE):
                im = im.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
            x[i] = np.asarray(im)
    return torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.tensor(ds.targets)


def _imagefolder(root: Path) -> tuple:
    from torchvision.datasets.folder import find_classes

    for part in ("train", "test"):
        if not (root / part).is_dir():
            raise DataError(f"image folder {root} has no {part}/ subfolder: expected {root}/{part}/<class>/*.jpg")
    classes, _ = find_classes(str(root / "train"))
    # Decoding tens of thousands of images takes a while: decode once, keep the uint8 tensors in a cache.
    stamp = f"{root.resolve()}|{(root / 'train').stat().st_mtime_ns}|{(root / 'test').stat().st_mtime_ns}"
    cache_dir = Path(os.environ.get("HETERO_CACHE", Path.home() / ".cache" / "hetero"))
    cache = cache_dir / f"imagefolder-{hashlib.sha1(stamp.encode()).hexdigest()[:16]}.pt"
    with _locked(cache_dir / ".hetero.lock"):
        if cache.exists():
            d = torch.load(cache, weights_only=True)
        else:
            d = {}
            d["train_x"], d["train_y"] = _decode_folder(root / "train", classes)
            d["test_x"], d["test_y"] = _decode_folder(root / "test", classes)
            tmp = cache.with_suffix(".tmp")
            torch.save(d, tmp)
            os.replace(tmp, cache)
    return d["train_x"], d["train_y"], d["test_x"], d["test_y"], classes


def _synthetic(n_train: int, n_test: int, n_classes: int = 10) -> tuple:
    """Learnable images: each class is a smooth random prototype, each sample its prototype plus noise."""
    g = torch.Generator().manual_seed(1234)  # the data never depends on the run seed
    protos = torch.nn.functional.interpolate(torch.rand(n_classes, 3, 4, 4, generator=g), size=IMAGE_SIZE,
                                             mode="bilinear", align_corners=False)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, n_classes, (n,), generator=g)
        x = 64 + 128 * protos[y] + 120 * torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
        return x.clamp(0, 255).to(torch.uint8), y

    (tx, ty), (vx, vy) = draw(n_train), draw(n_test)
    return tx, ty, vx, vy, [f"class{i}" for i in range(n_classes)]


def load_data(name: str, data_dir: str, subset: int = 0, test_subset: int = 0) -> DataSet:
    """Load a data set as uint8 tensors; subsets are fixed (independent of the run seed) so runs compare."""
    if name == "cifar10":
        tx, ty, vx, vy, classes = _cifar10(Path(data_dir))
    elif name == "imagefolder":
        tx, ty, vx, vy, classes = _imagefolder(Path(data_dir))
    elif name == "synthetic":
        tx, ty, vx, vy, classes = _synthetic(max(subset, SYNTHETIC_TRAIN), SYNTHETIC_TEST)
    else:
        raise DataError(f"unknown data set {name!r}")
    if subset:
        if subset > len(tx):
            raise DataError(f"--subset {subset} exceeds the {len(tx)} training images of {name}")
        keep = torch.randperm(len(tx), generator=torch.Generator().manual_seed(epoch_seed(0, 0, SUBSET)))[:subset]
        tx, ty = tx[keep], ty[keep]
    if test_subset and test_subset < len(vx):
        vx, vy = vx[:test_subset], vy[:test_subset]
    f = tx.float().div_(255)
    mean = tuple(f.mean((0, 2, 3)).tolist())
    std = tuple(f.std((0, 2, 3)).tolist())
    return DataSet(tx, ty.long(), vx, vy.long(), classes, mean, std)


class DeviceLoader:
    """Turns index batches into normalised float batches on `device`, augmenting there (crop with 4-pixel
    zero padding and horizontal flip, as torchvision's RandomCrop(32, 4) + RandomHorizontalFlip)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, mean, std, device: torch.device,
                 augment: bool, pad: int = 4):
        self.x, self.y = x.to(device), y.to(device)
        self.device, self.augment, self.pad = device, augment, pad
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255
        self.gen = torch.Generator(device=device)

    def seed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = idx.to(self.device)
        x, y = self.x[idx], self.y[idx]
        if self.augment and len(idx):
            x = self._crop_flip(x)
        return (x.float() - self.mean) / self.std, y

    def _crop_flip(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        p = self.pad
        xp = torch.nn.functional.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n, 1), device=self.device, generator=self.gen)
        dx = torch.randint(0, 2 * p + 1, (n, 1), device=self.device, generator=self.gen)
        flip = torch.rand(n, 1, device=self.device, generator=self.gen) < 0.5
        rows = dy + torch.arange(h, device=self.device)
        cols = torch.arange(w, device=self.device).expand(n, w)
        cols = torch.where(flip, w - 1 - cols, cols) + dx
        out = xp[torch.arange(n, device=self.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
        return out.permute(0, 3, 1, 2).contiguous()  # advanced indexing put channels last
