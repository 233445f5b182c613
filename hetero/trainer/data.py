"""Data sets held as uint8 tensors [N, 3, 32, 32], and a loader that augments index batches on the device.

Holding the whole (CIFAR-scale) set as one tensor lets a rank take any index slice of the shared permutation
at any step, with no DataLoader to rebuild when batch sizes change; on a GPU the set lives on the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core import safeio
from ..core.seeding import SUBSET, epoch_seed

IMAGE_SIZE = 32
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 10_000, 2_000
SYNTHETIC_MAX = 100_000  # CIFAR-10 twice over; drawing it takes ~4 GB of float intermediates


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
    try:
        fd = safeio.open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
    except OSError as e:
        raise DataError(f"cannot lock {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


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


@dataclass(frozen=True)
class ImageFile:
    """One image of an image folder, as scanned: what the decoded-image cache is keyed by."""
    path: str        # relative to the image folder's root
    label: int
    size: int        # bytes
    mtime_ns: int


def scan_folder(root: Path, part: str, classes: list[str]) -> list[ImageFile]:
    """The images of root/part/<class>/..., in torchvision ImageFolder's order, looked at without being opened.

    Symbolic links to folders below root/part are refused by name (a link can loop, `loop -> ..`, or pull another
    class's images in); links to files are followed. Anything not a regular file or folder (a FIFO, a device)
    is refused by name: opening a FIFO blocks until a writer comes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    folder = root / part
    found = _classes(folder)
    if found != classes:
        raise DataError(f"{folder} has classes {found}, expected {classes} as in the train folder")
    out: list[ImageFile] = []
    for label, c in enumerate(classes):
        walked: list[tuple[str, list[tuple[str, os.stat_result]]]] = []
        pending = [os.path.join(folder, c)]
        while pending:  # os.walk without following links, each folder's files stat-ed once
            top = pending.pop()
            files = []
            for e in os.scandir(top):
                where = os.path.join(top, e.name)
                if e.is_symlink():
                    try:
                        st = os.stat(where)
                    except OSError:
                        raise DataError(f"image folder {root}: {where} is a broken symbolic link (remove it)") \
                            from None
                    if stat.S_ISDIR(st.st_mode):
                        raise DataError(f"image folder {root}: {where} is a symbolic link to a folder; hetero does "
                                        f"not follow those (one can loop): replace it with the folder or its files")
                else:
                    st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(where)
                elif not stat.S_ISREG(st.st_mode):
                    raise DataError(f"image folder {root}: {where} is {safeio.file_kind(st.st_mode)}, not a regular "
                                    f"file: refusing to open it (remove it)")
                elif e.name.lower().endswith(IMG_EXTENSIONS):
                    files.append((e.name, st))
            walked.append((top, sorted(files, key=lambda f: f[0])))
        images = [ImageFile(os.path.relpath(os.path.join(top, name), root), label, st.st_size, st.st_mtime_ns)
                  for top, files in sorted(walked, key=lambda w: w[0]) for name, st in files]
        if not images:  # torchvision's own complaint names no folder
            raise DataError(f"class folder {folder / c} holds no images ({', '.join(IMG_EXTENSIONS)})")
        out += images
    return out


def _decode_folder(root: Path, images: list[ImageFile]) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    x = np.empty((len(images), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for i, f in enumerate(images):
        path = root / f.path
        try:
            safeio.regular_file(path, "image")  # scanned as one, but it may have been swapped since
            with Image.open(path) as im:
                im = im.convert("RGB")  # decodes: a truncated file fails here, not at open
                if im.size != (IMAGE_SIZE, IMAGE_SIZE):
                    im = im.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
                x[i] = np.asarray(im)
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, ... for bad files
            raise DataError(f"cannot decode image {path}: {type(e).__name__}: {e} (remove or replace it)") from None
    return torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.tensor([f.label for f in images])


def _classes(folder: Path) -> list[str]:
    """The class subfolders of an image folder, sorted (as torchvision's ImageFolder numbers them)."""
    links = sorted(e.name for e in os.scandir(folder) if e.is_symlink() and e.is_dir())
    if links:
        raise DataError(f"image folder {folder}: class folder {links[0]} is a symbolic link to a folder; hetero does "
                        f"not follow those (one can loop): replace it with the folder")
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False))
    if not classes:
        raise DataError(f"image folder {folder} has no class subfolders: expected {folder}/<class>/*.jpg")
    return classes


def _imagefolder(root: Path) -> tuple:
    for part in ("train", "test"):
        if not (root / part).is_dir():
            raise DataError(f"image folder {root} has no {part}/ subfolder: expected {root}/{part}/<class>/*.jpg")
    classes = _classes(root / "train")
    train, test = scan_folder(root, "train", classes), scan_folder(root, "test", classes)
    # Decoding tens of thousands of images takes a while: decode once, keep the uint8 tensors in a cache keyed by
    # the manifest of every file (path, size, mtime), so an added, removed or replaced image decodes afresh.
    manifest = json.dumps([str(root.resolve()), IMAGE_SIZE, classes, [dataclasses.astuple(f) for f in train],
                           [dataclasses.astuple(f) for f in test]])
    cache_dir = Path(os.environ.get("HETERO_CACHE", Path.home() / ".cache" / "hetero"))
    cache = cache_dir / f"imagefolder-{hashlib.sha256(manifest.encode()).hexdigest()[:24]}.pt"
    with _locked(cache_dir / ".hetero.lock"):
        d = _cached(cache, train, test)
        if d is None:
            d = {}
            d["train_x"], d["train_y"] = _decode_folder(root, train)
            d["test_x"], d["test_y"] = _decode_folder(root, test)
            try:
                safeio.atomic_write(cache, lambda fh: torch.save(d, fh))
            except OSError as e:  # the set is decoded: a cache that cannot be kept only costs the next start
                print(f"hetero: warning: cannot keep the image cache {cache}: "
                      f"{'disk full' if safeio.is_disk_full(e) else e.strerror or e}", file=sys.stderr)
    return d["train_x"], d["train_y"], d["test_x"], d["test_y"], classes


def _cached(cache: Path, train: list[ImageFile], test: list[ImageFile]) -> dict | None:
    """The cached tensors if they match the manifest (shapes, dtypes, the labels themselves), else None: a
    damaged or planted cache is decoded again. Tensors only (weights_only): a cache file cannot run code."""
    try:
        safeio.regular_file(cache, "cache")
        d = torch.load(cache, weights_only=True)
    except Exception:  # noqa: BLE001 - missing, a FIFO, unpickling errors: all mean decode again
        return None
    want = {"train": train, "test": test}
    try:
        for part, images in want.items():
            x, y = d[f"{part}_x"], d[f"{part}_y"]
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == torch.uint8
                    and tuple(x.shape) == (len(images), 3, IMAGE_SIZE, IMAGE_SIZE) and y.dtype == torch.int64
                    and torch.equal(y, torch.tensor([f.label for f in images], dtype=torch.int64))):
                return None
    except (KeyError, TypeError, IndexError):
        return None
    return d


def _synthetic(n_train: int, n_test: int, n_classes: int = 10) -> tuple:
    """Learnable images: each class is a smooth random prototype, each sample its prototype plus noise."""
    g = torch.Generator().manual_seed(1234)  # the data never depends on the run seed
    protos = torch.nn.functional.interpolate(torch.rand(n_classes, 3, 4, 4, generator=g), size=IMAGE_SIZE,
                                             mode="bilinear", align_corners=False)
    base = 64 + 128 * protos  # per class, before indexing: the same values as 64 + 128 * protos[y]

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # 64 + 128 * protos[y] + 120 * noise, in place (the same bits, half the CPU: every rank of a launch draws it)
        y = torch.randint(0, n_classes, (n,), generator=g)
        x = base[y].add_(torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g).mul_(120))
        return x.clamp_(0, 255).to(torch.uint8), y

    (tx, ty), (vx, vy) = draw(n_train), draw(n_test)
    return tx, ty, vx, vy, [f"class{i}" for i in range(n_classes)]


def load_data(name: str, data_dir: str, subset: int = 0, test_subset: int = 0) -> DataSet:
    """Load a data set as uint8 tensors; subsets are fixed (independent of the run seed) so runs compare."""
    if name == "cifar10":
        tx, ty, vx, vy, classes = _cifar10(Path(data_dir))
    elif name == "imagefolder":
        tx, ty, vx, vy, classes = _imagefolder(Path(data_dir))
    elif name == "synthetic":
        if subset > SYNTHETIC_MAX:  # checked before drawing: the set is generated at the --subset size
            raise DataError(f"--subset {subset} exceeds the largest synthetic set ({SYNTHETIC_MAX} images)")
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
    zero padding and horizontal flip, as torchvision's RandomCrop(32, 4) + RandomHorizontalFlip). Batches come
    in `memory_format` (the model's) without a per-step conversion: the held set is stored in it, and the
    augmenting gather writes it directly."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, mean, std, device: torch.device,
                 augment: bool, pad: int = 4, memory_format: torch.memory_format = torch.contiguous_format):
        self.x, self.y = x.to(device).contiguous(memory_format=memory_format), y.to(device)
        self.device, self.augment, self.pad, self.memory_format = device, augment, pad, memory_format
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
        """Random crops and flips of a uint8 batch in one gather, whose output is already in self.memory_format
        (the index shapes decide the layout: [n, h, w, c] memory for channels-last, [n, c, h, w] otherwise)."""
        n, c, h, w = x.shape
        p = self.pad
        xp = torch.nn.functional.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n, 1), device=self.device, generator=self.gen)
        dx = torch.randint(0, 2 * p + 1, (n, 1), device=self.device, generator=self.gen)
        flip = torch.rand(n, 1, device=self.device, generator=self.gen) < 0.5
        rows = dy + torch.arange(h, device=self.device)
        cols = torch.arange(w, device=self.device).expand(n, w)
        cols = torch.where(flip, w - 1 - cols, cols) + dx
        batch = torch.arange(n, device=self.device)
        if self.memory_format == torch.channels_last:  # advanced indexing puts the channels (the slice) last
            return xp[batch[:, None, None], :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
        chans = torch.arange(c, device=self.device)
        return xp[batch[:, None, None, None], chans[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]
