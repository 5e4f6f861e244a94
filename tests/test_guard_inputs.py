"""`rankaudit guard` on hostile inputs (a client runs it on what a server sends): outputs that would overwrite an
input, a log that is a pipe or in a missing folder, a forward that never returns, labels and .npz files that are
not what they say. Each is one line and its exit code, never an internal error or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch
from conftest import REPO
from torch import nn

MODEL = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

class TakesADict(MLP):
    # A model that is fine in its own app, which hands it {"x": batch}: the guard gives it one tensor.
    def forward(self, batch):
        return super().forward(batch["x"])

class Stalls(MLP):
    # A forward that traces on the meta device and then never returns on the client's real samples.
    def forward(self, x):
        while not x.is_meta:
            pass
        return super().forward(x)
"""


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 3)


@pytest.fixture
def client(tmp_path):
    (tmp_path / "net.py").write_text(MODEL)
    torch.manual_seed(0)
    torch.save(MLP().state_dict(), tmp_path / "w.pt")
    generator = np.random.default_rng(0)
    x = generator.random((6, 12), dtype=np.float32)
    y = generator.integers(0, 3, 6)
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return tmp_path


def guard(run_cli, client, *args, data="batch.npz", model="net.py:MLP"):
    return run_cli("guard", client / model, "--weights", client / "w.pt", "--data", client / data, *args)


def one_line(err: str, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rankaudit: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_log_of_its_own_gets_one_line_per_decision(run_cli, client):
    code, out, err = guard(run_cli, client, "--log", client / "guard.jsonl")
    assert code in (0, 1) and out and not err.strip(), err  # a small MLP: a unit may well fire for one sample
    assert (client / "guard.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("target", ["w.pt", "x.npy", "y.npy", "net.py", "batch.npz"])
def test_the_report_never_overwrites_an_input(run_cli, client, target):
    before = (client / target).read_bytes()
    data = ("x.npy", "--labels", client / "y.npy") if target in ("x.npy", "y.npy") else ("batch.npz",)
    code, out, err = guard(run_cli, client, *data[1:], "-o", client / target, data=data[0])
    assert code == 2 and out == ""
    one_line(err, f"-o {client / target}", "the report would overwrite it")
    assert (client / target).read_bytes() == before


@pytest.mark.parametrize("target", ["w.pt", "net.py", "batch.npz"])
def test_the_log_never_appends_to_an_input(run_cli, client, target):
    before = (client / target).read_bytes()
    code, _, err = guard(run_cli, client, "--log", client / target)
    assert code == 2
    one_line(err, f"--log {client / target}", "the report would overwrite it")
    assert (client / target).read_bytes() == before


def test_the_log_through_a_link_to_the_weights_is_refused(run_cli, client):
    os.symlink(client / "w.pt", client / "innocent.jsonl")
    code, _, err = guard(run_cli, client, "--log", client / "innocent.jsonl")
    assert code == 2 and "the weights input" in one_line(err)


def test_the_log_and_the_report_in_one_file_are_refused(run_cli, client):
    code, _, err = guard(run_cli, client, "--log", client / "out.txt", "-o", client / "out.txt")
    assert code == 2
    one_line(err, "-o and --log both name")


def test_a_log_that_is_a_pipe_or_in_a_missing_folder_is_refused(run_cli, client):
    os.mkfifo(client / "pipe")
    started = time.monotonic()
    code, _, err = guard(run_cli, client, "--log", client / "pipe")
    assert code == 2 and time.monotonic() - started < 30
    one_line(err, "named pipe (FIFO)", "regular file")
    code, _, err = guard(run_cli, client, "--log", client / "missing" / "guard.jsonl")
    assert code == 2
    one_line(err, "does not exist", "create the folder")


@pytest.mark.parametrize("option", ["--weights", "--data", "--labels"])
@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
def test_an_input_that_is_a_pipe_or_a_folder_is_said_for_what_it_is(run_cli, client, option, kind):
    named = client / "folder"
    if kind == "a FIFO":
        os.mkfifo(client / "pipe")
        named = client / "pipe"
    else:
        named.mkdir()
    given = {"--weights": client / "w.pt", "--data": client / "x.npy", "--labels": client / "y.npy", option: named}
    started = time.monotonic()
    code, out, err = run_cli("guard", client / "net.py:MLP", *(word for pair in given.items() for word in pair))
    assert code == 2 and out == "" and time.monotonic() - started < 30
    one_line(err, f"{option} {named} is {kind}, not a regular file", "; fix: save the")


def test_a_log_the_pyproject_names_is_checked_too(run_cli, client):
    (client / "pyproject.toml").write_text(f'[tool.rankaudit.guard]\nlog = "{client / "w.pt"}"\n')
    code, _, err = guard(run_cli, client)
    assert code == 2
    one_line(err, "--log", "the weights input")


def _labels(client, values) -> None:
    x = np.load(client / "x.npy")
    np.savez(client / "bad.npz", x=x, y=np.asarray(values))


@pytest.mark.parametrize(
    "labels, fragment",
    [
        ([0, 1, 2, 3, 0, 1], "a label is 3, but the model gives 3 class scores"),
        ([0, 1, -1, 2, 0, 1], "the labels hold -1"),
        (np.array([0, 1, 2, 0, 1, np.iinfo(np.uint64).max], dtype=np.uint64), "18446744073709551615"),
        (np.zeros((6, 3), dtype=np.int64), "labels of shape (6, 3)"),
        (np.zeros(6, dtype=bool), "(bool)"),
        (np.zeros(6, dtype=np.float32), "(float32)"),
    ],
    ids=["out-of-range", "negative", "uint64-max", "2-D", "bool", "float"],
)
def test_labels_that_are_not_class_indices_are_one_line(run_cli, client, labels, fragment):
    _labels(client, labels)
    code, _, err = guard(run_cli, client, data="bad.npz")
    assert code == 2
    one_line(err, fragment)


def test_pickled_object_arrays_are_refused_unread(run_cli, client):
    x = np.load(client / "x.npy")
    objects = np.empty(6, dtype=object)
    objects[:] = [0, 1, 2, 0, 1, 2]
    with zipfile.ZipFile(client / "pickled.npz", "w") as archive:  # what np.savez writes, with a pickled member
        for name, value in (("x", x), ("y", objects)):
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, value, allow_pickle=True)
    code, _, err = guard(run_cli, client, data="pickled.npz")
    assert code == 2
    one_line(err, "its y could not be read", "no object arrays")
    np.save(client / "labels.npy", objects, allow_pickle=True)
    code, _, err = guard(run_cli, client, "--labels", client / "labels.npy", data="x.npy")
    assert code == 2
    one_line(err, "--labels", "could not be read as NumPy data")


def test_corrupt_and_truncated_archives_are_one_line(run_cli, client):
    whole = (client / "batch.npz").read_bytes()
    (client / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    code, _, err = guard(run_cli, client, data="truncated.npz")
    assert code == 2
    one_line(err, "truncated.npz")
    corrupt = bytearray(whole)
    start = whole.index(b"y.npy") + 200  # inside the y member's data: its checksum no longer matches
    corrupt[start : start + 16] = b"\xff" * 16
    (client / "corrupt.npz").write_bytes(bytes(corrupt))
    code, _, err = guard(run_cli, client, data="corrupt.npz")
    assert code == 2
    one_line(err, "corrupt.npz")


def test_complex_and_non_finite_samples_are_refused(run_cli, client):
    x, y = np.load(client / "x.npy"), np.load(client / "y.npy")
    np.savez(client / "complex.npz", x=x + 1j * x, y=y)
    code, _, err = guard(run_cli, client, data="complex.npz")
    assert code == 2
    one_line(err, "complex", "real-valued")
    x[2, 3] = np.nan
    np.savez(client / "nan.npz", x=x, y=y)
    code, _, err = guard(run_cli, client, data="nan.npz")
    assert code == 2
    one_line(err, "NaN")


def test_a_forward_that_never_returns_ends_at_the_timeout(client):
    """The local training runs under --timeout like the model's load: here the trace passes (meta tensors) and the
    first real forward loops, in a fresh process as the user runs it."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rankaudit", "guard", client / "net.py:Stalls", "--weights", client / "w.pt"]
        + ["--data", client / "batch.npz", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 3 and done.stdout == ""
    one_line(done.stderr, "the local training on the --data samples did not finish within 5 s", "--timeout")
    assert elapsed < 30, elapsed


def test_a_model_that_takes_another_input_is_told_what_it_was_given(run_cli, client):
    code, _, err = guard(run_cli, client, model="net.py:TakesADict")
    assert code == 3
    one_line(err, "net.py:", "TypeError", "or give it the input its forward() takes")


def test_samples_the_model_cannot_take_and_labels_that_do_not_match_get_one_line():
    """Guard.decide as an adapter calls it: samples in a shape the model does not take, labels for other samples
    and tensors without values each get one line with the cause and the fix, not the model's own error."""
    from rankaudit.errors import UsageError
    from rankaudit.guard.decide import Guard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    x, y = torch.rand(12, 64), torch.randint(4, (12,))
    nn.functional.cross_entropy(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
    cases = {
        "the model could not run on the samples given to the guard, of shape (12, 8, 8)": (sent, x.view(12, 8, 8), y),
        "the guard was given 5 labels for 12 samples": (sent, x, y[:5]),
        "the guard was given samples on the meta device": (sent, x.to("meta"), y),
        "the guard was given sent 0.weight on the meta device": (
            {**sent, "0.weight": sent["0.weight"].to("meta")},
            x,
            y,
        ),
        "the guard was given no samples": (sent, None, y),
        "the guard was given labels it cannot read as numbers": (sent, x, np.array(["cat"] * 12)),
        "the guard was given the sent weights as NoneType": (None, x, y),
        "the guard was given 1 labels for 64 samples (the samples have no batch dimension": (sent, x[0], y[:1]),
    }
    for expected, (update, samples, labels) in cases.items():
        with pytest.raises(UsageError) as caught:
            Guard(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))).decide(
                received, update, samples, labels
            )
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value) and caught.value.fix


def test_a_list_of_sample_tensors_and_a_model_as_the_sent_weights_are_taken_as_they_are():
    """What a training loop has at hand: the samples as a list of tensors (stacked) and the trained model itself
    (its state dict) give the same decision as a batch and a state dict."""
    from rankaudit.guard.decide import Guard

    def fresh() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))

    torch.manual_seed(1)
    model = fresh()
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    x, y = torch.rand(6, 16), torch.randint(3, (6,))
    nn.functional.cross_entropy(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
    plain = Guard(fresh()).decide(received, sent, x, y)[0]
    handy = Guard(fresh()).decide(received, model, list(x), y)[0]
    assert (plain.action, plain.exact_samples) == (handy.action, handy.exact_samples)
    assert plain.exact_samples  # six samples, eight units: some unit fires for one of them


def test_weights_to_send_with_other_names_are_blamed_on_the_update_not_on_the_server():
    """A training wrapper that prefixes every name ("module." from DataParallel) changes what would be sent, not
    what the server sent: the block says so."""
    from rankaudit.guard.decide import Guard

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    sent = {f"module.{name}": value.clone() for name, value in received.items()}
    decision, to_send = Guard(model).decide(received, sent, torch.rand(4, 8), torch.randint(2, (4,)))
    assert decision.action == "block" and to_send is None
    assert decision.reasons[0].startswith("the weights to send are not the audited model's: the update changes module.")
    as_integers = {name: (value * 100).to(torch.int8) for name, value in received.items()}
    decision, to_send = Guard(model).decide(received, as_integers, torch.rand(4, 8), torch.randint(2, (4,)))
    assert decision.action == "block" and "0.weight (sent as int8)" in decision.reasons[0]


def test_weights_to_send_of_another_shape_are_blamed_on_the_update_not_on_the_samples():
    """A transposed weight in what would be sent: the model cannot be run at the sent weights, and the block names
    the weight and its shape, not the samples."""
    from rankaudit.guard.decide import Guard

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    sent = {**received, "0.weight": received["0.weight"].T.contiguous()}
    decision, to_send = Guard(model).decide(received, sent, torch.rand(4, 8), torch.randint(2, (4,)))
    assert decision.action == "block" and to_send is None
    assert (
        decision.reasons[0]
        == "the weights to send are not the audited model's: the update changes 0.weight (shape (8, 4))"
    )
