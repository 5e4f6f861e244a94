"""method.md: the certificate, read from samples: the printed h judged by held-out real samples (photographs and a
tabular set the code was not fitted on), their hidden shares computed here from the exact visible subspace of each
front end, independently of the package."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rankaudit.audit import audit
from rankaudit.bound.quantile import order_statistic, samples_needed

pytest.importorskip("sklearn", reason="needs scikit-learn, not installed (pip install -e '.[test]')")


def allowed_below(count: int, miss: float = 0.10, surprise: float = 0.01) -> int:
    """The most of `count` held-out samples that may fall below a true (1 − miss) certificate: the count that
    Binomial(count, miss) exceeds with probability under `surprise` (10 % plus binomial noise)."""
    tail, most = 1.0, count
    for below in range(count + 1):
        tail -= math.comb(count, below) * miss**below * (1 - miss) ** (count - below)
        if tail < surprise:
            most = below
            break
    return most


def hidden_shares(deviations: np.ndarray, visible_rows: np.ndarray) -> np.ndarray:
    """Each deviation's share of its squared norm outside the row space of `visible_rows` (the front end's
    Jacobian: for every weight value the gradient reads the input only through it)."""
    basis = np.linalg.svd(visible_rows, full_matrices=False)[2]
    basis = basis[: np.linalg.matrix_rank(visible_rows)]
    seen = ((deviations @ basis.T) ** 2).sum(1)
    total = (deviations**2).sum(1)
    return 1 - seen / total


def test_the_order_statistic_is_a_95_percent_lower_bound_on_the_10_percent_quantile():
    for count in (29, 100, 540, 1257):
        k = order_statistic(count, 0.1, 0.95)

        def below(j, n=count):
            return sum(math.comb(n, i) * 0.1**i * 0.9 ** (n - i) for i in range(j))

        assert below(k) <= 0.05 < below(k + 1), count
    assert order_statistic(28, 0.1, 0.95) == 0 and order_statistic(29, 0.1, 0.95) == 1
    assert samples_needed(0.1, 0.95) == 29


def _photographs(names):
    from sklearn.datasets import load_sample_images

    photos = {"china": 0, "flower": 1}
    images = load_sample_images().images
    return [np.asarray(images[photos[name]], dtype=np.float64) / 255.0 for name in names]


def _crops(photos, size: int, count: int, seed: int, widest: int = 1, narrowest: int = 4) -> np.ndarray:
    """Crops with a side between short/narrowest and short/widest, area-averaged to size (not the package's own
    resampling)."""
    generator = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        photo = photos[generator.integers(len(photos))]
        height, width = photo.shape[:2]
        short = min(height, width)
        side = int(generator.integers(max(size, short // narrowest), short // widest + 1))
        top, left = generator.integers(0, height - side + 1), generator.integers(0, width - side + 1)
        crop = torch.from_numpy(np.ascontiguousarray(photo[top : top + side, left : left + side])).permute(2, 0, 1)
        out.append(F.adaptive_avg_pool2d(crop[None], size)[0].numpy())
    return np.stack(out)


def _pooling_rows(size: int, window: int) -> np.ndarray:
    rows = []
    for channel in range(3):
        for top in range(0, size, window):
            for left in range(0, size, window):
                row = np.zeros((3, size, size))
                row[channel, top : top + window, left : left + window] = 1.0
                rows.append(row.ravel())
    return np.array(rows)


POOLING = (
    "import torch.nn as nn\nINPUT_SHAPE = (3, 8, 8)\n"
    "class M(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.pool = nn.AvgPool2d(4)\n"
    "        self.fc = nn.Linear(12, 10)\n"
    "    def forward(self, x):\n"
    "        return self.fc(self.pool(x).flatten(1).relu())\n"
)

PROJECTION = (
    "import numpy as np, torch, torch.nn as nn\nINPUT_SHAPE = {shape}\n"
    "class M(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.register_buffer('front', torch.tensor(np.load({rows!r}), dtype=torch.float32))\n"
    "        self.fc = nn.Linear({width}, 10)\n"
    "    def forward(self, x):\n"
    "        return self.fc(x.flatten(1) @ self.front.T)\n"
)


def _judged(model, fit: np.ndarray, held_out: np.ndarray, rows: np.ndarray, tmp_path):
    """Audit with --data = the fit split; the held-out samples' hidden shares of their deviation from the fit
    split's mean (the reference mean) outside the front end's rows; (sample bound, shares)."""
    data = tmp_path / "fit.npy"
    np.save(data, fit.astype(np.float32))
    result = audit(str(model), data=str(data))
    shares = hidden_shares(held_out.reshape(len(held_out), -1) - fit.reshape(len(fit), -1).mean(0), rows)
    return result.identifiability, shares


def _top_rows(fit: np.ndarray, count: int) -> np.ndarray:
    flat = fit.reshape(len(fit), -1)
    return np.linalg.svd(flat - flat.mean(0), full_matrices=False)[2][:count]


# The principal-components front (20 s) runs with the slow cases.
@pytest.mark.parametrize("front", ["avg-pool 4", pytest.param("top-12 principal components", marks=pytest.mark.slow)])
def test_with_data_at_most_10_percent_of_held_out_photograph_crops_hide_less_than_h(front, tmp_path):
    """3x8x8 crops of scikit-learn's photographs cut by a rule of this test's own: 700 for --data, 600 held out. The
    Gaussian-model quantile had 15 % (pooling) and 21-24 % (the data's own top-12 directions, the subspace the
    method's proof calls worst) of held-out crops below it; the order statistic of the samples holds both to 10 %
    plus binomial noise, and `partial` never stands where more than 10 % of them hide less than 5 %."""
    photos = _photographs(("china", "flower"))
    fit, held_out = _crops(photos, 8, 700, seed=3), _crops(photos, 8, 600, seed=4)
    if front == "avg-pool 4":
        model = tmp_path / "pool.py"
        model.write_text(POOLING)
        rows = _pooling_rows(8, 4)
    else:
        rows = _top_rows(fit, 12)
        np.save(tmp_path / "rows.npy", rows)
        model = tmp_path / "projection.py"
        model.write_text(PROJECTION.format(shape=(3, 8, 8), rows=str(tmp_path / "rows.npy"), width=12))
    bound, shares = _judged(model, fit, held_out, rows, tmp_path)
    sample = bound.sample
    assert sample.rank_bound == 12 and bound.certificate_samples == 700
    below = int((shares < sample.certified_hidden_energy).sum())
    assert below <= allowed_below(600), (front, sample.certified_hidden_energy, below)
    assert 0 < sample.certified_hidden_energy < sample.expected_hidden_energy  # the expectation stays beside it
    if (shares < bound.exposed_below).sum() > allowed_below(600):
        assert sample.level == "exposed"


def test_with_data_a_tabular_set_with_a_fixed_pca_front_end_holds_on_held_out_rows(tmp_path):
    """sklearn's digits, standardised on the fit rows, 540 held out; a fixed projection on the fit rows' top-4
    principal directions. The Gaussian model printed h 0.437 with 18 % of the held-out rows below it (their 10th
    percentile 0.40); read from the 1,257 fit rows, h is 0.35 and 5 % of held-out rows are below it."""
    from sklearn.datasets import load_digits

    rows_all = load_digits().data.astype(np.float64)
    order = np.random.default_rng(0).permutation(len(rows_all))
    held, fit = order[:540], order[540:]
    mean, spread = rows_all[fit].mean(0), rows_all[fit].std(0)
    spread[spread == 0] = 1
    standard = (rows_all - mean) / spread
    rows = _top_rows(standard[fit], 4)
    np.save(tmp_path / "rows.npy", rows)
    model = tmp_path / "pca.py"
    model.write_text(PROJECTION.format(shape=(64,), rows=str(tmp_path / "rows.npy"), width=4))
    bound, shares = _judged(model, standard[fit], standard[held], rows, tmp_path)
    certified = bound.sample.certified_hidden_energy
    assert bound.sample.rank_bound == 4 and 0.3 < certified < 0.4
    assert int((shares < certified).sum()) <= allowed_below(540), (certified, float(np.mean(shares < certified)))
    assert "1,257 samples" in bound.spectrum and "95 % lower confidence bound on the 10 % quantile" in bound.spectrum


def test_the_report_states_the_samples_and_the_confidence(tmp_path, run_cli):
    photos = _photographs(("china",))
    data = tmp_path / "fit.npy"
    np.save(data, _crops(photos, 8, 300, seed=5).astype(np.float32))
    model = tmp_path / "pool.py"
    model.write_text(POOLING)
    _, out, _ = run_cli(model, "--data", data, "--format", "json")
    identifiability = json.loads(out)["identifiability"]
    assert identifiability["certificate_samples"] == 300 and identifiability["certificate_confidence"] == 0.95
    assert "the 22nd smallest of their 300 hidden shares" in identifiability["spectrum"]
    _, table, _ = run_cli(model, "--data", data)
    assert "90 % of samples like yours (read from your 300 samples, 95 % confidence)" in table


def test_the_self_check_measures_each_sample_from_the_reference_mean(tmp_path, run_cli):
    """--verify rank's hidden share of each attacked sample is its deviation from --data's mean outside the pooling
    windows, as computed here; not its deviation from its own mean."""
    photos = _photographs(("flower",))
    crops = _crops(photos, 8, 200, seed=6)
    data = tmp_path / "fit.npy"
    np.save(data, crops.astype(np.float32))
    model = tmp_path / "pool.py"
    model.write_text(POOLING)
    _, out, _ = run_cli(model, "--data", data, "--verify", "rank", "--samples", 3, "--format", "json", "-q")
    entries = json.loads(out)["verification"]["rank"]["worst_first"]
    stored = np.load(data).astype(np.float64).reshape(200, -1)
    expected = hidden_shares(stored[:3] - stored.mean(0), _pooling_rows(8, 4))
    own_mean = hidden_shares(stored[:3] - stored[:3].mean(1, keepdims=True), _pooling_rows(8, 4))
    for entry in entries:
        assert entry["hidden_energy"] == pytest.approx(expected[entry["index"]], abs=1e-6)
        assert entry["hidden_energy"] != pytest.approx(own_mean[entry["index"]], abs=1e-6)


POOLED = (
    "import torch.nn as nn\nINPUT_SHAPE = (3, {size}, {size})\n"
    "class M(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.pool = nn.AvgPool2d(4)\n"
    "        self.fc = nn.Linear({pooled}, 10)\n"
    "    def forward(self, x):\n"
    "        return self.fc(self.pool(x).flatten(1).relu())\n"
)


@pytest.mark.parametrize("size", [8, pytest.param(16, marks=pytest.mark.slow)])  # 16 px: about 30 s each
@pytest.mark.parametrize("rule", [(1, 3), (3, 10)])  # a side between short/3 and all of it; short/10 and short/3
def test_without_data_the_shipped_photographs_reference_holds_on_photographs_it_was_not_fitted_on(size, rule, tmp_path):
    """scikit-image's `astronaut` and `rocket` (the shipped table was fitted on scikit-learn's photographs and
    scikit-image's `coffee` and `chelsea`), cut by crop rules of this test's own and area-averaged: at most 10 % plus
    binomial noise of 600 crops hide less than the printed h, for a pooling model (its windows' span, exactly) and
    for the crops' own top principal directions at other ranks (the worst subspace for them, read in-sample)."""
    skimage_data = pytest.importorskip("skimage.data", reason="needs scikit-image (pip install -e '.[test]')")
    from rankaudit.bound.energy import reference_for

    photos = [np.asarray(getattr(skimage_data, name)(), dtype=np.float64) / 255.0 for name in ("astronaut", "rocket")]
    crops = _crops(photos, size, 600, seed=size + rule[1], widest=rule[0], narrowest=rule[1])
    deviations = crops.reshape(600, -1) - np.asarray(_shipped_mean(size))
    model = tmp_path / "pool.py"
    model.write_text(POOLED.format(size=size, pooled=3 * (size // 4) ** 2))
    sample = audit(str(model)).identifiability.sample
    shares = hidden_shares(deviations, _pooling_rows(size, 4))
    assert int((shares < sample.certified_hidden_energy).sum()) <= allowed_below(600), sample.certified_hidden_energy
    centred = crops.reshape(600, -1) - crops.reshape(600, -1).mean(0)
    directions = np.linalg.svd(centred, full_matrices=False)[2]
    table = reference_for((3, size, size), 3 * size * size).photo_shares
    for rank in (1, 3, 12, 24):
        certified = table.certificate(rank, 0.9)[0]
        shares = hidden_shares(centred, directions[:rank])
        assert int((shares < certified).sum()) <= allowed_below(600), (rank, certified)


def _shipped_mean(size: int) -> np.ndarray:
    from rankaudit.bound.energy import reference_mean

    return reference_mean((3, size, size))
