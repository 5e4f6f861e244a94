"""The client-side guard: its decision on real updates (an honest CNN sends, an MLP unit that fires for one sample
and an imprint module block), its actions, its settings and the command (the NVFlare filter: test_guard_nvflare.py)."""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.guard.decide import Guard
from rankaudit.settings.guard_options import GuardSettings, from_run_config, guard_settings


def trained(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int | None = None, lr: float = 0.1) -> dict:
    """The state dict after the client's local SGD steps (torch.optim, float32), as a framework's client sends it."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batch = batch or len(x)
    for start in range(0, len(x), batch):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch]).backward()
        optimizer.step()
    return model.state_dict()


def state(model: nn.Module) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x)).mean(dim=(2, 3))
        return self.out(torch.relu(self.hidden(x)))


class MLP(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(48, width)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def batch(count: int, shape=(3, 4, 4), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, *shape, generator=generator), torch.randint(10, (count,), generator=generator)


def one_sample_unit(sample: int = 2):
    """An MLP whose first-layer unit 0 fires for one sample of the batch alone; every other unit for none."""
    torch.manual_seed(0)
    model, (x, y) = MLP(), batch(8)
    flat = x.flatten(1)
    with torch.no_grad():
        direction = flat[sample] - flat.mean(0)
        scores = flat @ direction
        runner_up = scores[torch.arange(8) != sample].max()
        model.fc1.weight.zero_()
        model.fc1.weight[0] = direction
        model.fc1.bias.fill_(-1.0)
        model.fc1.bias[0] = -(scores[sample] + runner_up) / 2
    return model, x, y


def imprint(model: MLP, x: torch.Tensor) -> MLP:
    """Robbing the Fed's imprint module in fc1: every row the mean brightness, the biases thresholds between the
    samples, the output columns equal."""
    model = copy.deepcopy(model)
    brightness = x.flatten(1).mean(1).sort().values
    thresholds = torch.cat([brightness[:1] - 1.0, (brightness[1:] + brightness[:-1]) / 2])
    units = model.fc1.out_features
    with torch.no_grad():
        model.fc1.weight.fill_(1 / 48)
        model.fc1.bias.copy_(-torch.cat([thresholds, thresholds[-1:] + 10.0 * torch.arange(1, units - len(x) + 1)]))
        model.fc2.weight.copy_(torch.randn(10, 1).expand(10, units))
    return model


def test_an_ordinary_cnn_with_honest_weights_sends():
    torch.manual_seed(0)
    model, (x, y) = SmallCNN(), batch(16, (3, 12, 12))
    decision, sent = Guard(model).decide(state(model), trained(model, x, y, batch=8), x, y)
    assert decision.action == "send" and decision.exact_samples == [] and decision.reasons == []
    assert "hidden" in decision.layers_checked
    assert sent is not None


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("local_batch", [4, 16])
def test_honest_cnns_send_across_seeds_and_batches(seed, local_batch):
    """The tolerance's calibration: fresh weights, other data, small and large local batches, momentum."""
    torch.manual_seed(seed)
    model, (x, y) = SmallCNN(), batch(16, (3, 12, 12), seed=seed)
    moved = copy.deepcopy(model)
    optimizer = torch.optim.SGD(moved.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):  # two local epochs
        for start in range(0, len(x), local_batch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(
                moved(x[start : start + local_batch]), y[start : start + local_batch]
            ).backward()
            optimizer.step()
    decision, _ = Guard(model).decide(state(model), moved.state_dict(), x, y)
    assert decision.action == "send", decision.reasons


def test_arrays_sent_as_a_list_are_named_in_the_models_order():
    """Flower's legacy clients send a list of arrays (an ArrayRecord keyed "0", "1", ...)."""
    model, x, y = one_sample_unit()
    numbered = lambda weights: {str(i): value for i, value in enumerate(weights.values())}  # noqa: E731
    decision, _ = Guard(model).decide(numbered(state(model)), numbered(trained(model, x, y)), x, y)
    assert decision.action == "block" and decision.exact_samples == [2]


def test_an_mlp_whose_first_layer_fires_for_one_sample_blocks_naming_it():
    model, x, y = one_sample_unit(sample=2)
    decision, sent = Guard(model).decide(state(model), trained(model, x, y), x, y)
    assert decision.action == "block" and sent is None
    assert decision.exact_samples == [2]
    first = [r for r in decision.readouts if r.layer == "fc1"]
    assert [(r.units, r.kind, r.sample) for r in first] == [([0], "ratio", 2)]
    assert first[0].reads_input and 50 < first[0].psnr == decision.psnr[2] or decision.psnr[2] > first[0].psnr
    # The unit's row is sample 2's own deviation from the batch's mean: fc2 reads its features, which determine it.
    assert all(readout.leaks == (readout.sample == 2) for readout in decision.readouts)


def test_the_samples_go_through_in_chunks_with_the_same_decision(monkeypatch):
    from rankaudit.guard import readout

    model, x, y = one_sample_unit(sample=5)
    received, computed = state(model), trained(model, x, y)
    whole, _ = Guard(model).decide(received, computed, x, y)
    monkeypatch.setattr(readout, "CHUNK", 3)
    chunked, _ = Guard(model).decide(received, computed, x, y)
    assert whole.exact_samples == chunked.exact_samples == [5]
    assert [(r.layer, r.units, r.kind, r.sample) for r in whole.readouts] == [
        (r.layer, r.units, r.kind, r.sample) for r in chunked.readouts
    ]


def test_an_imprint_module_blocks_through_pairs_of_units():
    torch.manual_seed(0)
    x, y = batch(8)
    model = imprint(MLP(width=16), x)
    decision, _ = Guard(model).decide(state(model), trained(model, x, y), x, y)
    assert decision.action == "block"
    kinds = {readout.kind for readout in decision.readouts}
    assert "pair" in kinds
    assert len(decision.exact_samples) >= 6  # each sample alone between two thresholds
    assert all(readout.psnr >= decision.min_psnr for readout in decision.readouts)


def test_a_changed_architecture_blocks_before_anything_else():
    torch.manual_seed(0)
    model, (x, y) = MLP(), batch(4)
    received = state(MLP(width=20))
    decision, sent = Guard(model).decide(received, received, x, y)
    assert decision.action == "block" and sent is None
    assert decision.architecture and "shapes differ" in decision.architecture
    received = {name: value.double() for name, value in state(model).items()}
    decision, _ = Guard(model).decide(received, received, x, y)
    assert "dtypes differ" in decision.reasons[0]


@pytest.mark.parametrize("action", ["drop", "noise"])
def test_drop_and_noise_send_an_update_that_no_longer_reads_a_sample(action):
    torch.manual_seed(0)
    x, y = batch(8)
    model = imprint(MLP(width=16), x)
    received, computed = state(model), trained(model, x, y)
    decision, sent = Guard(model, GuardSettings(action=action)).decide(received, computed, x, y)
    assert decision.action == action and sent is not None
    assert decision.changed == ["fc1.bias", "fc1.weight"]
    assert torch.equal(sent["fc2.weight"], computed["fc2.weight"])  # only the offending rows change
    again, _ = Guard(model).decide(received, sent, x, y)
    assert again.action == "send", again.reasons


def test_no_two_clients_draw_the_same_noise_unless_seeded():
    torch.manual_seed(0)
    x, y = batch(8)
    model = imprint(MLP(width=16), x)
    received, computed = state(model), trained(model, x, y)

    def noised(settings):
        return Guard(model, settings).decide(received, computed, x, y)[1]["fc1.weight"]

    assert not torch.equal(noised(GuardSettings(action="noise")), noised(GuardSettings(action="noise")))
    assert torch.equal(noised(GuardSettings(action="noise", seed=7)), noised(GuardSettings(action="noise", seed=7)))


def test_every_decision_is_one_json_line(tmp_path):
    log = tmp_path / "guard.jsonl"
    model, x, y = one_sample_unit()
    guard = Guard(model, GuardSettings(log=str(log)))
    guard.decide(state(model), trained(model, x, y), x, y, round_number=3)
    guard.decide(state(model), state(model), x, y, round_number=4)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["round"] for line in lines] == [3, 4]
    assert lines[0]["action"] == "block" and lines[0]["exact_samples"] == [2] and "fc1" in lines[0]["layers"]
    assert lines[0]["psnr"]["2"] > 50
    assert lines[1]["action"] == "send"  # no update, nothing read
    assert all(isinstance(line["seconds"], float) for line in lines)


def test_the_visible_energy_check_blocks_a_sample_the_gradient_shows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))
    x, y = torch.rand(2, 3, 2, 2), torch.tensor([0, 2])
    settings = GuardSettings(energy_budget=60.0, min_hidden=0.05)
    decision, _ = Guard(model, settings).decide(state(model), trained(model, x, y), x, y)
    assert decision.energy["measured"]
    assert 0.0 <= decision.energy["hidden"] < 0.05  # 24 unknowns, 515 gradient values: full rank
    assert decision.action == "block" and "hides only" in decision.reasons[-1]
    tight = GuardSettings(energy_budget=1e-9)
    decision, _ = Guard(model, tight).decide(state(model), trained(model, x, y), x, y)
    assert not decision.energy["measured"] and "budget" in decision.energy["note"]
    # Two samples: any two first-layer units combine into a readout of either sample, energy check or not.
    assert decision.action == "block" and decision.exact_samples == [0, 1]
    assert not any("hides only" in reason for reason in decision.reasons)
    decision, _ = Guard(model, settings).decide(state(model), trained(model, x, y), x)
    assert decision.energy is None and "needs the samples' labels" in decision.notes[0]


def test_settings_are_checked_and_the_run_config_only_tightens():
    with pytest.raises(UsageError, match="action"):
        guard_settings({"action": "warn"})
    with pytest.raises(UsageError, match="unknown key"):
        guard_settings({"tolerence": 1e-3})
    with pytest.raises(UsageError, match="tolerance was replaced by min-psnr"):
        guard_settings({"tolerance": 1e-3})
    with pytest.raises(UsageError, match="min-psnr"):
        guard_settings({"min_psnr": 0})
    with pytest.raises(UsageError, match="feature-action"):
        guard_settings({"feature_action": "noise"})
    base = guard_settings({"action": "noise", "noise_scale": 2})
    chosen = from_run_config({"rankaudit-guard-action": "drop", "lr": 0.1}, base=base)
    assert chosen.action == "drop" and chosen.noise_scale == 2.0


def test_the_pyproject_table(tmp_path):
    from rankaudit.settings.pyproject import load_settings

    (tmp_path / "pyproject.toml").write_text('[tool.rankaudit.guard]\naction = "drop"\nmin-psnr = 25\n')
    settings = load_settings(tmp_path / "net.py")
    assert settings.guard == GuardSettings(action="drop", min_psnr=25.0)
    (tmp_path / "pyproject.toml").write_text('[tool.rankaudit.guard]\nactoin = "drop"\n')
    with pytest.raises(UsageError, match="unknown key actoin"):
        load_settings(tmp_path / "net.py")


# ---- the command --------------------------------------------------------------------------------------------------

MODELS = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(48, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x)).mean(dim=(2, 3))
        return self.out(torch.relu(self.hidden(x)))
"""


@pytest.fixture
def client(tmp_path):
    (tmp_path / "nets.py").write_text(MODELS)
    torch.manual_seed(0)
    torch.save(SmallCNN().state_dict(), tmp_path / "cnn.pt")
    x, y = batch(16, (3, 12, 12))
    np.savez(tmp_path / "cnn.npz", x=x.numpy(), y=y.numpy())
    model, x, y = one_sample_unit()
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    np.save(tmp_path / "mlp_x.npy", x.numpy())
    np.save(tmp_path / "mlp_y.npy", y.numpy())
    return tmp_path


def test_the_command_sends_honest_cnn_weights(run_cli, client):
    code, out, _ = run_cli(
        "guard",
        client / "nets.py:CNN",
        "--weights",
        client / "cnn.pt",
        "--data",
        client / "cnn.npz",
        "-b",
        "8",
        "--format",
        "json",
    )
    report = json.loads(out)
    assert code == 0 and report["guard"]["action"] == "send"
    assert report["guard"]["exact_samples"] == [] and report["guard"]["min_psnr"] == 30.0
    # Pooled features may be read; what they determine of each photograph is far under the threshold.
    assert all(report["guard"]["psnr"][str(s)] < 30 for s in report["guard"]["feature_samples"])
    assert report["round"]["batch_size"] == 8 and report["round"]["steps"] == 2
    assert report["seconds"] > 0


def test_the_command_blocks_and_names_the_sample(run_cli, client):
    code, out, _ = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "mlp.pt",
        "--data",
        client / "mlp_x.npy",
        "--labels",
        client / "mlp_y.npy",
    )
    assert code == 1
    assert out.splitlines()[0].endswith("block: nothing is sent this round")
    assert "read: sample 2 (" in out
    assert len(out.splitlines()) <= 6


def test_the_command_blocks_other_weights(run_cli, client):
    code, out, _ = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "cnn.pt",
        "--data",
        client / "mlp_x.npy",
        "--labels",
        client / "mlp_y.npy",
        "--format",
        "json",
    )
    assert code == 1 and "not the audited model's" in json.loads(out)["guard"]["reasons"][0]


def test_the_command_names_bad_input(run_cli, client):
    code, _, err = run_cli(
        "guard", client / "nets.py:MLP", "--weights", client / "mlp.pt", "--data", client / "mlp_x.npy"
    )
    assert code == 2 and "needs their labels" in err and "--labels" in err
    code, _, err = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "mlp.pt",
        "--data",
        client / "cnn.npz",
        "--local-samples",
        "99",
    )
    assert code == 2 and "--local-samples" in err
    code, _, err = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "mlp.pt",
        "--data",
        client / "mlp_x.npy",
        "--labels",
        client / "mlp_y.npy",
        "--action",
        "drop",
        "--tolerance",
        "-1",
    )
    assert code == 2 and "tolerance" in err
    code, _, err = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "mlp.pt",
        "--data",
        client / "mlp_x.npy",
        "--labels",
        client / "mlp_y.npy",
        "--clients",
        "4",
    )
    assert code == 2 and "--clients" in err and "one client" in err


# ---- NVFlare --------------------------------------------------------------------------------------------------------


def test_naming_the_filter_without_nvflare_says_how_to_install_it(monkeypatch):
    import rankaudit.guard.nvflare as guard_nvflare

    for name in ["nvflare"] + [name for name in sys.modules if name.startswith("nvflare.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed, also where another test imported it
    monkeypatch.setattr(guard_nvflare, "_BUILT", {})
    with pytest.raises(ImportError, match="pip install nvflare"):
        guard_nvflare.RankauditGuardFilter  # noqa: B018


def test_the_retired_tolerance_flag_says_what_replaced_it(run_cli, client):
    code, _, err = run_cli(
        "guard",
        client / "nets.py:MLP",
        "--weights",
        client / "mlp.pt",
        "--data",
        client / "mlp_x.npy",
        "--tolerance",
        "1e-3",
    )
    assert code == 2 and "--tolerance was replaced by --min-psnr" in err and len(err.strip().splitlines()) == 1


def test_the_energy_budget_is_a_hard_limit_on_time_and_memory():
    import time

    from rankaudit.guard.energy import within

    started = time.perf_counter()
    status, why = within(lambda: time.sleep(30), 0.5)
    assert status == "over" and "ran past the 0.5 s budget" in why and time.perf_counter() - started < 10
    status, why = within(lambda: bytearray(1 << 50), 30)  # a petabyte: past any machine's free memory
    assert status == "over" and "not measured" in why
    assert within(lambda: 6 * 7, 30) == ("done", 42)
