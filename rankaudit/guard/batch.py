"""The client's samples, as the guard takes them: from the files given to `rankaudit guard` (a .npz with x and y, or a
.npy with a labels .npy), or from what a Flower or NVFlare app's own code returns (a DataLoader, a dataset, tensors,
arrays, (x, y) pairs, dict batches). Whatever cannot be a batch of real-valued samples with one class label each is
one line naming what is expected; nothing here runs code from the files (no pickles).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping

import numpy as np
import torch

from rankaudit.errors import UsageError
from rankaudit.settings.files import input_file

# The keys a dict batch keeps its samples and labels under: Flower Datasets' image sets use "img"/"image" and
# "label"; Hugging Face's vision processors "pixel_values"; the rest are common spellings.
SAMPLE_KEYS = ("img", "image", "pixel_values", "input_ids", "x", "input", "inputs", "features", "data")
LABEL_KEYS = ("label", "labels", "y", "target", "targets", "fine_label")
# What `samples` may return, said whenever it returned something else.
EXPECTED = (
    "a DataLoader (or the (train, test) pair of them), a dataset, a tensor or array of samples (batch first), "
    "(samples, labels), or dict batches with an image key (img, image, ...) and a label key (label, ...)"
)
_LARGEST_LABEL = np.iinfo(np.int64).max


def _read_npy(path: str, option: str):
    """np.load of a regular file, without pickles; every failure one line naming the file."""
    fix = (
        "save the labels to a file with np.save and name it"
        if option == "--labels"
        else "save the client's batch to a file, a .npz (x, y) or a .npy, and name it"
    )
    input_file(path, option, fix)
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - a truncated, corrupt or pickled file: said, not raised through
        raise UsageError(f"{option} {path} could not be read as NumPy data ({error_line(exc)})", _SAVE_HINT) from None


_SAVE_HINT = "save plain numeric arrays with np.save or np.savez (no object arrays)"


def error_line(exc: Exception) -> str:
    """An exception as one line, its type and its message's first line (a traceback is not said)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _npz_member(loaded, key: str, data: str) -> np.ndarray:
    """One array of a .npz, read now: a truncated member, a corrupt archive or an object array is one line."""
    try:
        return np.asarray(loaded[key])
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as exc:
        raise UsageError(f"--data {data}: its {key} could not be read ({error_line(exc)})", _SAVE_HINT) from None


def load_batch(data: str, labels: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, labels) from a .npz with x and y, or a .npy with a labels .npy; one line and exit 2 otherwise."""
    loaded = _read_npy(data, "--data")
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            keys = set(loaded.files)
            if not {"x", "y"} <= keys:
                raise UsageError(
                    f"--data {data} holds {', '.join(sorted(keys)) or 'nothing'}, not x and y",
                    "save the batch with np.savez(path, x=samples, y=labels)",
                )
            if labels is not None:
                raise UsageError("--labels given with a .npz that holds y", "drop --labels, or give a .npy as --data")
            x, y = _npz_member(loaded, "x", data), _npz_member(loaded, "y", data)
    else:
        if labels is None:
            raise UsageError(
                f"--data {data} holds samples only: the local step needs their labels",
                "add --labels LABELS.npy, or save np.savez(path, x=samples, y=labels)",
            )
        x, y = loaded, _read_npy(labels, "--labels")
        if isinstance(y, np.lib.npyio.NpzFile):
            y.close()
            raise UsageError(f"--labels {labels} is a .npz archive", "save the labels alone with np.save(path, y)")
    return checked_samples(x, f"--data {data}"), checked_labels(y, len(x))


def as_model_input(model: torch.nn.Module, samples: torch.Tensor, input_dtype=None) -> torch.Tensor:
    """The samples as the model takes them: integer samples stay integers when the model reads token ids (its
    declared input dtype is an integer one, or it has an embedding); anything else in the model's floating dtype."""
    samples = samples.detach()
    if not samples.is_floating_point() and not samples.is_complex():
        if isinstance(input_dtype, torch.dtype) and not input_dtype.is_floating_point and not input_dtype.is_complex:
            return samples.to(input_dtype)
        if any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) for m in model.modules()):
            return samples.to(torch.int64)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return samples.to(dtype)


def checked_samples(x: np.ndarray, where: str) -> torch.Tensor:
    """Real, finite samples, batch first: integers (token ids, or pixels a model converts itself) as int64, anything
    else as float32 (what clients train in); as_model_input gives them to the model."""
    if np.iscomplexobj(x):
        raise UsageError(
            f"{where}: the samples are complex ({x.dtype})", "give real-valued samples (the real part, or both)"
        )
    if x.ndim < 2 or x.shape[0] == 0 or not np.issubdtype(x.dtype, np.number):
        raise UsageError(f"{where}: samples of shape {x.shape} ({x.dtype})", "give numeric samples, batch first")
    # In NumPy, not torch: `rankaudit guard` reads the batch before it forks the model's worker, and a torch operation
    # large enough to start its thread pool there leaves the forked worker waiting on threads it does not have.
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        return torch.from_numpy(np.array(x, dtype=np.int64))
    with np.errstate(over="ignore", invalid="ignore"):
        array = np.ascontiguousarray(x, dtype=np.float32)
    if not bool(np.isfinite(array).all()):
        raise UsageError(f"{where}: the samples hold NaN or infinite values (in float32)", "give finite samples")
    return torch.from_numpy(array.copy() if array is x or not array.flags.writeable else array)


def checked_labels(y: np.ndarray, count: int) -> torch.Tensor:
    """One non-negative integer class label per sample, as int64."""
    if y.ndim != 1 or len(y) != count or not np.issubdtype(y.dtype, np.integer):
        raise UsageError(
            f"labels of shape {y.shape} ({y.dtype}) for {count} samples",
            "give one integer class label per sample (a 1-D integer array; class indices, not one-hot rows)",
        )
    if len(y) and (int(y.min()) < 0 or int(y.max()) > _LARGEST_LABEL):
        worst = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise UsageError(f"the labels hold {worst}, not a class index", "give class indices 0, 1, ... (one per sample)")
    return torch.as_tensor(y.astype(np.int64, copy=False))


def check_label_range(labels: torch.Tensor, classes: int) -> None:
    """Every label names one of the model's `classes` outputs (cross-entropy); one line otherwise."""
    if len(labels) and int(labels.max()) >= classes:
        raise UsageError(
            f"a label is {int(labels.max())}, but the model gives {classes} class scores (0 to {classes - 1})",
            "give labels that index the model's outputs",
        )


# ---- what an app's `samples` function returns -----------------------------------------------------------------


def _loaders(found) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(found, DataLoader)


def _as_array(value, where: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value):
        return np.stack([_as_array(v, where) for v in value])
    if isinstance(value, (list, tuple, int, float)):
        try:
            array = np.asarray(value)
        except ValueError:
            array = None
        if array is not None and array.dtype != object:
            return array
    raise UsageError(f"{where} returned a {type(value).__name__}, not samples", f"return {EXPECTED}")


def _split(item, where: str) -> tuple[object, object]:
    """(samples, labels or None) of one batch or one item: a dict with known keys, a pair, or samples alone."""
    if isinstance(item, Mapping):
        sample = next((key for key in SAMPLE_KEYS if key in item), None)
        label = next((key for key in LABEL_KEYS if key in item), None)
        if sample is None:
            raise UsageError(
                f"{where} gave dict batches with keys {', '.join(map(str, item))}, and none holds the samples",
                "name the samples img, image or input_ids (and the labels label), as Flower Datasets and Hugging "
                "Face tokenizers do",
            )
        return item[sample], None if label is None else item[label]
    if isinstance(item, (tuple, list)) and len(item) == 2 and not _numbers(item):
        return item[0], item[1]
    return item, None


def _numbers(item) -> bool:
    return all(isinstance(value, (int, float)) for value in item)


def _collected(batches, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The batches of a DataLoader (or the items of a dataset, one sample each: stacked) as one array each."""
    xs, ys = [], []
    for batch in batches:
        x, y = _split(batch, where)
        xs.append(_as_array(x, where))
        ys.append(None if y is None else _as_array(y, where))
    if not xs:
        raise UsageError(f"{where} returned no samples (an empty loader or dataset)", "return this round's samples")
    labelled = all(y is not None for y in ys)
    return xs, (ys if labelled else None)


def client_samples(found, where: str = "samples(context)") -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    """(samples as float32, labels as int64 or None, notes) from what an app's `samples` function returned."""
    notes = []
    if isinstance(found, (tuple, list)) and len(found) >= 2 and all(_loaders(part) for part in found):
        # The quickstart's load_data returns (trainloader, testloader): the client trains on the first.
        notes.append(f"{where} returned {len(found)} DataLoaders: the guard took the first, the training one")
        found = found[0]
    if _loaders(found):
        xs, ys = _collected(found, where)
        x = np.concatenate(xs)
        y = None if ys is None else np.concatenate([np.reshape(part, (-1,)) for part in ys])
    elif isinstance(found, (torch.Tensor, np.ndarray)) or isinstance(found, Mapping):
        x, y = _split(found, where)
        x, y = _as_array(x, where), None if y is None else _as_array(y, where)
    elif isinstance(found, (tuple, list)) and len(found) == 2:
        x, y = _as_array(found[0], where), None if found[1] is None else _as_array(found[1], where)
    elif hasattr(found, "__len__") and hasattr(found, "__getitem__") and not isinstance(found, (str, bytes)):
        # A map-style dataset (torch's, or a Hugging Face partition): its items, one sample each.
        xs, ys = _collected((found[index] for index in range(len(found))), where)
        x = np.stack(xs)
        y = None if ys is None else np.asarray([np.reshape(part, ()) for part in ys])
    else:
        raise UsageError(f"{where} returned a {type(found).__name__}", f"return {EXPECTED}")
    samples = checked_samples(x, where)
    labels = (
        None if y is None else checked_labels(np.reshape(y, (-1,)) if y.ndim == 2 and y.shape[1] == 1 else y, len(x))
    )
    return samples, labels, notes
