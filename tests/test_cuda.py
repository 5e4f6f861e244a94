"""The verifier's CUDA path: runs wherever a GPU is present, skipped cleanly where none is."""

import json

import pytest
import torch
from conftest import EXAMPLES

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none (CI on a GPU runner runs it)"
)


def test_rgap_on_cuda_reconstructs_cnn6(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "cnn6.py", "--verify", "rgap", "--device", "cuda", "--samples", "2", "--format", "json"
    )
    verification = json.loads(out)["verification"]["rgap"]
    assert verification["device"].startswith("cuda") and verification["median_mse"] < 1e-3
    assert [layer["local_deficit"] for layer in verification["layers"]] == [0] * 7


def test_gdbr_and_the_optimisation_attack_on_cuda(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "lenet10.py",
        "--withheld-layers",
        "fc2",
        "--verify",
        "gdbr",
        "-b",
        "64",
        "--device",
        "cuda",
        "--format",
        "json",
    )
    gdbr = json.loads(out)["verification"]["gdbr"]
    assert gdbr["device"].startswith("cuda") and gdbr["ins_acc"] > gdbr["chance_ins_acc"]
    code, out, _ = run_cli(
        EXAMPLES / "resnet18_w16.py",
        "--verify",
        "rgap",
        "--device",
        "cuda",
        "--samples",
        "1",
        "--steps",
        "20",
        "--format",
        "json",
    )
    assert json.loads(out)["verification"]["rgap"]["device"].startswith("cuda")


def _inverting_on(device, monkeypatch=None, graphs=True):
    from test_invert import over_determined_net, photo_patches

    from rankaudit.verify.attacks import invert, invert_loop

    if monkeypatch is not None:
        monkeypatch.setattr(invert_loop, "_CUDA_GRAPHS", graphs)
    # Over-determined (64 unknowns against a 64x256 first-layer gradient): every image is recovered.
    model = over_determined_net().double()
    images = photo_patches(1, 8, 3).double()
    return invert.run_inverting(model, images, "cross-entropy", steps=300, restarts=2, device=device, seed=0)


def test_the_batched_attack_replays_a_cuda_graph_and_matches_plain_launches(monkeypatch):
    graphed = _inverting_on("cuda", monkeypatch, graphs=True)
    plain = _inverting_on("cuda", monkeypatch, graphs=False)
    assert [o.cuda_graph for o in graphed.outcomes] == [True] * 3
    assert [o.cuda_graph for o in plain.outcomes] == [False] * 3
    assert all(o.per_sample_gradients == "vmap" for o in graphed.outcomes)
    assert graphed.steps_run == plain.steps_run == [600] * 3
    assert torch.allclose(graphed.x_hat, plain.x_hat, atol=1e-9, rtol=0)
    assert max(graphed.mse) < 1e-6, graphed.mse


def test_the_batched_attack_on_cuda_recovers_what_it_recovers_on_cpu():
    on_gpu = _inverting_on("cuda")
    on_cpu = _inverting_on("cpu")
    assert on_gpu.device.startswith("cuda") and on_cpu.device == "cpu"
    assert on_gpu.recovered_labels == on_cpu.recovered_labels == on_cpu.labels
    assert max(on_gpu.mse) < 1e-6 and max(on_cpu.mse) < 1e-6, (on_gpu.mse, on_cpu.mse)


def _rank_on(device, example):
    from rankaudit.audit import audit
    from rankaudit.verify.client import draw_labels, loss_name_for
    from rankaudit.verify.model import build_real_model
    from rankaudit.verify.rank import jacobian as rank

    spec = str(EXAMPLES / f"{example}.py")
    result = audit(spec)
    model, _ = build_real_model(spec, result.input_shape, 0)
    images = torch.rand((1, *result.input_shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        logits = model(images).numel()
    loss = loss_name_for(logits)
    return rank.measure(model, images, draw_labels(1, loss, logits, 0), device=device, seed=0, loss=loss)


@pytest.mark.parametrize("example, expected", [("fig2_e", 3036), ("vit_tiny", 768)])
def test_rank_sketch_on_cuda(example, expected):
    """The same ranks as on the CPU (tests/test_rank.py), with chunks sized from the GPU's free memory."""
    measured = _rank_on("cuda", example)
    assert measured.device.startswith("cuda") and measured.rank == expected and measured.reliable
    assert measured.chunk_rows > 8  # the probe chunk's measured memory made the later chunks larger


def test_verify_rank_on_cuda_from_the_cli(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "vit_tiny.py", "--verify", "rank", "--device", "cuda", "--samples", "2", "--format", "json"
    )
    verification = json.loads(out)["verification"]["rank"]
    assert verification["device"].startswith("cuda") and verification["rank"] == verification["unknowns"] == 768


def test_the_dp_attack_on_cuda_stays_below_the_bound(run_cli):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    code, out, _ = run_cli(
        EXAMPLES / "cnn6.py",
        "--dp-noise",
        "1",
        "--dp-clip",
        "0.01",
        "--verify",
        "dp",
        "--samples",
        "2000",
        "--device",
        "cuda",
        "--format",
        "json",
        "--fail-on",
        "never",
    )
    attack = json.loads(out)["verification"]["dp"]
    assert code == 0 and attack["device"].startswith("cuda") and attack["draw"] == "full"
    assert attack["interval"][0] <= attack["bound"] and attack["success_rate"] > attack["prior"]


def test_rank_check_of_the_mobile_examples_on_cuda_matches_the_cpu():
    """Issue 16: hardsigmoid's stand-in, float32 rows and the device-sized sketch on the GPU; same rank as the CPU's
    664 of 768."""
    from conftest import measured_rank

    from rankaudit.verify.client import draw_labels
    from rankaudit.verify.model import build_real_model
    from rankaudit.verify.rank import jacobian as rank

    for example in ("mobilenetv3_tiny", "lcnet_tiny"):
        result, on_cpu = measured_rank(example)
        model, _ = build_real_model(str(EXAMPLES / f"{example}.py"), result.input_shape, 0)
        images = torch.rand((1, *result.input_shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        labels = draw_labels(1, "cross-entropy", 10, 0)
        on_gpu = rank.measure(model, images, labels, device="cuda", seed=0, loss="cross-entropy", precision="auto")
        assert on_gpu.device.startswith("cuda") and on_gpu.rank == on_cpu.rank == 664
        assert on_gpu.precision == "float64"  # a deficit is always settled in float64


def test_device_memory_budget_and_non_finite_refusal_on_cuda(run_cli, tmp_path):
    from rankaudit.verify.rank import budget

    available, rule = budget.memory_budget("cuda")
    assert available > 0 and "free" in rule
    path = tmp_path / "net.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\nINPUT_SHAPE = (1, 4, 4)\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(16, 4)\n\n"
        "    def forward(self, x):\n        return self.fc(torch.log(x.flatten(1) - 2.0))\n"
    )
    code, _, err = run_cli(path, "--verify", "rank", "--device", "cuda", "--samples", "1")
    assert code == 3 and "first NaN/Inf from torch.log" in err
