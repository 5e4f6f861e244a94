"""Real input images for the verifier's attacks: photograph crops, an image folder, or a .npy array."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rankaudit.settings.files import not_a_file

__all__ = ["DataError", "held_images", "load_images"]

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
# ITU-R BT.601 luma, the weights PIL's "L" conversion uses.
_LUMA = (0.299, 0.587, 0.114)


class DataError(Exception):
    """The image source cannot give the requested images; the message names the problem and the fix."""


def load_images(source: str | None, shape: tuple[int, int, int], n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """N x C x H x W float images in [0, 1] and a short description of where they came from.

    source None: seeded random crops of the photographs shipped with scikit-learn (never noise);
    a directory: its PNG/JPEG files, sorted, the first n; a .npy file: N x C x H x W or N x H x W x C,
    uint8 0-255 or float 0-1.
    """
    c, h, w = (int(s) for s in shape)
    if c not in (1, 3):
        raise DataError(
            f"images with {c} channels are not supported: use a model input with 1 (grey) or 3 (RGB) channels"
        )
    if n < 1:
        raise DataError(f"asked for {n} images: ask for at least 1")
    if source is None:
        return _photo_crops(c, h, w, n, seed), f"{n} random crops of scikit-learn's sample photographs (seed {seed})"
    path = Path(source)
    if path.is_dir():
        return _from_directory(path, c, h, w, n)
    kind = not_a_file(path)  # a FIFO would block the read
    if kind is not None:
        raise DataError(
            f"{source} is {kind}, not a regular file: save the images to a .npy file or a folder of PNG/JPEG files"
        )
    if path.suffix.lower() == ".npy":
        return _from_npy(path, c, h, w, n)
    if not path.exists():
        raise DataError(f"image source {source!r} does not exist: give a directory of PNG/JPEG files or a .npy file")
    raise DataError(f"image source {source!r} is neither a directory nor a .npy file: give one of those")


def held_images(source: str) -> int | None:
    """How many images an image folder or a .npy holds (None where that cannot be told: load_images names why)."""
    path = Path(source)
    try:
        if path.is_dir():
            return sum(1 for p in path.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file())
        if path.suffix.lower() == ".npy" and path.is_file():
            return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])
    except Exception:
        return None
    return None


def _to_channels(img: torch.Tensor, c: int) -> torch.Tensor:
    """(3|1, H, W) -> (c, H, W)."""
    if img.shape[0] == c:
        return img
    if c == 1:
        luma = torch.tensor(_LUMA, dtype=img.dtype).view(3, 1, 1)
        return (img * luma).sum(0, keepdim=True)
    return img.expand(3, -1, -1).clone()


def _resize(img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    if tuple(img.shape[-2:]) == (h, w):
        return img
    out = F.interpolate(img[None], size=(h, w), mode="bilinear", align_corners=False, antialias=True)[0]
    # Bilinear with antialiasing can overshoot slightly at edges.
    return out.clamp(0, 1)


def _photo_crops(c: int, h: int, w: int, n: int, seed: int) -> torch.Tensor:
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise DataError(
            "the default images need scikit-learn and pillow: pip install scikit-learn pillow, "
            "or pass an image directory/.npy"
        ) from exc
    photos = [torch.from_numpy(np.array(im)).permute(2, 0, 1).double() / 255.0 for im in load_sample_images().images]
    tallest = max(photo.shape[1] for photo in photos)
    widest = max(photo.shape[2] for photo in photos)
    if h > min(photo.shape[1] for photo in photos) or w > min(photo.shape[2] for photo in photos):
        # A crop would have to be blown up past the photograph itself (3x512x512 failed inside randint).
        raise DataError(
            f"the input {h}x{w} is larger than scikit-learn's sample photographs ({tallest}x{widest}), "
            "the default images: a --data source is needed; fix: pass --data DIR (PNG/JPEG images) or "
            f"--data FILE.npy (N x {c} x {h} x {w} in [0, 1])"
        )
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        photo = photos[int(torch.randint(len(photos), (), generator=gen))]
        ph, pw = photo.shape[1:]
        # Crops between a quarter and the whole of the shorter side keep recognisable structure
        # at every target size while giving different content per sample.
        side_max = min(ph, pw)
        side_min = max(min(h, w), side_max // 4)
        side = int(torch.randint(side_min, side_max + 1, (), generator=gen))
        ch = side
        cw = min(pw, max(1, round(side * w / h)))
        top = int(torch.randint(0, ph - ch + 1, (), generator=gen))
        left = int(torch.randint(0, pw - cw + 1, (), generator=gen))
        crop = photo[:, top : top + ch, left : left + cw]
        out.append(_to_channels(_resize(crop, h, w), c))
    return torch.stack(out).float()


def _from_directory(path: Path, c: int, h: int, w: int, n: int) -> tuple[torch.Tensor, str]:
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError("reading an image directory needs pillow: pip install pillow") from exc
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"no PNG/JPEG files in {path}: put .png/.jpg images there or pass a .npy file")
    if len(files) < n:
        raise DataError(f"{path} has {len(files)} PNG/JPEG files but {n} are needed: add images or ask for fewer")
    out = []
    for f in files[:n]:
        try:
            with Image.open(f) as im:
                arr = np.asarray(im.convert("RGB"))
        except Exception as exc:  # PIL raises several types for corrupt files
            raise DataError(f"cannot read {f} ({type(exc).__name__}): replace or remove the file") from exc
        img = torch.from_numpy(arr.copy()).permute(2, 0, 1).double() / 255.0
        out.append(_to_channels(_resize(img, h, w), c))
    return torch.stack(out).float(), f"{n} images from {path}"


def _from_npy(path: Path, c: int, h: int, w: int, n: int) -> tuple[torch.Tensor, str]:
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError as exc:
        raise DataError(f"{path} does not exist: give an existing .npy file") from exc
    except Exception as exc:
        raise DataError(f"cannot read {path} as a .npy array ({type(exc).__name__}): save it with numpy.save") from exc
    if arr.ndim == 3:
        arr = arr[:, None]  # N x H x W grey images
    if arr.ndim != 4:
        raise DataError(f"{path} has shape {arr.shape}: expected N x C x H x W or N x H x W x C")
    if arr.shape[1] in (1, 3):
        data = arr
    elif arr.shape[-1] in (1, 3):
        data = np.moveaxis(arr, -1, 1)
    else:
        raise DataError(f"{path} has shape {arr.shape}: no axis of 1 or 3 channels at position 1 or last")
    if data.shape[0] < n:
        raise DataError(f"{path} holds {data.shape[0]} images but {n} are needed: add images or ask for fewer")
    data = data[:n]
    if data.dtype == np.uint8:
        t = torch.from_numpy(np.ascontiguousarray(data)).double() / 255.0
        kind = "uint8"
    elif np.issubdtype(data.dtype, np.floating):
        t = torch.from_numpy(np.ascontiguousarray(data)).double()
        if not torch.isfinite(t).all() or t.min() < 0 or t.max() > 1:
            raise DataError(
                f"{path} holds floats outside [0, 1] (min {float(t.min()):.3g}, max {float(t.max()):.3g}):"
                " scale them to [0, 1] or save uint8 0-255"
            )
        kind = "float"
    else:
        raise DataError(f"{path} has dtype {data.dtype}: save uint8 0-255 or float 0-1")
    imgs = [_to_channels(_resize(t[i], h, w), c) for i in range(n)]
    return torch.stack(imgs).float(), f"{n} images from {path.name} ({kind})"
