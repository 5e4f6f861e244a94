"""suggest's Opacus lines: pasted into a training script they run, and Opacus's own accountant agrees with the noise
multiplier rankaudit found for a target ε."""

import re

import pytest
from conftest import TABULAR_NET


@pytest.mark.slow  # Opacus's import and its own noise search: about half a minute on two busy cores
def test_the_opacus_lines_run_and_opacus_agrees_on_the_noise_for_a_target_epsilon(run_cli, tmp_path):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    opacus = pytest.importorskip("opacus", reason="needs Opacus (pip install opacus)")
    import torch
    from opacus.accountants.utils import get_noise_multiplier

    model_file = tmp_path / "tabular.py"
    model_file.write_text(TABULAR_NET)
    # 64 local samples in batches of 16 (q = 1/4), two local epochs: T = 8 steps.
    code, out, _ = run_cli(
        "suggest",
        model_file,
        "--local-samples",
        "64",
        "-b",
        "16",
        "--local-epochs",
        "2",
        "--dp-clip",
        "0.5",
        "--target-epsilon",
        "3",
    )
    assert code == 0
    target = next(line for line in out.splitlines() if line.startswith("Target ε 3 (q 0.25, T 8, δ 1e-05)"))
    sigma = float(re.search(r"σ = ([0-9.]+)", target).group(1))
    # Opacus's own PRV accountant, asked the same question, lands within its and our discretisation of it.
    theirs = get_noise_multiplier(target_epsilon=3, target_delta=1e-5, sample_rate=0.25, steps=8, accountant="prv")
    assert sigma == pytest.approx(theirs, rel=0.03)
    pasted = [line.split(":", 1)[1] if line.lstrip().startswith("or let") else line for line in out.splitlines()]
    pasted = [line.split("  #")[0].strip() for line in pasted if "PrivacyEngine()." in line]
    fixed = next(line for line in pasted if "make_private(" in line)
    by_epsilon = next(line for line in pasted if "make_private_with_epsilon(" in line)
    assert fixed.startswith("Opacus: ") and f"noise_multiplier={sigma:g}" in fixed

    def train_with(line: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        data = torch.utils.data.TensorDataset(torch.rand(64, 12), torch.randint(0, 3, (64,)))
        scope = {
            "PrivacyEngine": opacus.PrivacyEngine,
            "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "train_loader": torch.utils.data.DataLoader(data, batch_size=16),
        }
        exec(line.removeprefix("Opacus: "), scope)
        return scope["optimizer"]

    optimizer = train_with(fixed)
    assert (optimizer.noise_multiplier, optimizer.max_grad_norm) == (sigma, 0.5)
    optimizer = train_with(by_epsilon)  # Opacus's search at q = 1/len(loader) over epochs × len(loader) steps
    assert optimizer.noise_multiplier == pytest.approx(sigma, rel=0.03) and optimizer.max_grad_norm == 0.5
