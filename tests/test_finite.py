"""Bad numbers refused: every verifier names the first op that made the output or the shared gradient non-finite,
and exits 3 (rankaudit/verify/finite.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from rankaudit.verify import finite

# The two misbehaving ops both models are built with: one breaks the forward pass, one only its backward.
ODD_OPS = """
    class LogOfShifted(nn.Module):
        # log(|h| - 100): NaN wherever |h| < 100, which is everywhere at these weights
        def forward(self, h):
            return torch.log(h.abs() - 100.0)


    class SqrtAtZero(nn.Module):
        # sqrt(0) is finite, its derivative 1 / (2 sqrt(0)) is not
        def forward(self, h):
            return h + torch.sqrt(F.relu(h) * 0.0)
"""

IMAGE_MODEL = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    INPUT_SHAPE = (1, 4, 4)

{odd_ops}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc0 = nn.Linear(16, 16)
            self.odd = {module}()
            self.fc1 = nn.Linear(16, 8)
            self.fc2 = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(self.odd(self.fc0(x.flatten(1))))))
"""

TOKEN_MODEL = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    INPUT_SHAPE = (4,)
    INPUT_DTYPE = torch.long

{odd_ops}

    class Net(nn.Module):
        def __init__(self, vocabulary=50, width=8):
            super().__init__()
            self.embedding = nn.Embedding(vocabulary, width)
            self.norm = nn.LayerNorm(width)
            self.q = nn.Linear(width, width)
            self.odd = {module}()
            self.head = nn.Linear(width, vocabulary)

        def forward(self, ids):
            return self.head(self.odd(self.q(self.norm(self.embedding(ids)))))
"""

FORWARD = ("LogOfShifted", "the forward pass is not finite at the inputs: first NaN/Inf from torch.log in module odd")
BACKWARD = (
    "SqrtAtZero",
    "the shared gradient is not finite at the inputs (the forward pass is): first NaN/Inf from "
    "the backward of torch.sqrt in module odd (SqrtBackward0)",
)


@pytest.mark.parametrize("where", [FORWARD, BACKWARD], ids=["forward-op", "backward-op"])
@pytest.mark.parametrize(
    "verifier, flags, label",
    [
        ("rank", ("--samples", "1"), "--verify rank"),
        ("rgap", ("--samples", "1", "--steps", "2"), "--verify rgap (inverting gradients)"),
        ("gdbr", ("--trials", "1", "-b", "4"), "--verify gdbr"),
        ("dager", (), "--verify dager"),
    ],
)
def test_every_verifier_names_the_op_that_made_a_non_finite_value_and_exits_3(
    run_cli, tmp_path, verifier, flags, label, where
):
    module, message = where
    source = TOKEN_MODEL if verifier == "dager" else IMAGE_MODEL
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(source.replace("{odd_ops}", ODD_OPS)).replace("{module}", module))
    code, out, err = run_cli(f"{path}:Net", "--verify", verifier, *flags)
    assert code == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert f"{label}: {message}" in lines[0] and "fix:" in lines[0]
    assert out == "" or "rank" not in out


def test_rgap_refuses_a_non_finite_weight_before_any_attack(run_cli, tmp_path):
    """R-GAP itself (a chain it can solve), on weights the file loads with an Inf in them."""
    path = tmp_path / "net.py"
    path.write_text(
        textwrap.dedent("""
        import math
        import torch.nn as nn

        INPUT_SHAPE = (1, 4, 4)


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 20)
                self.act = nn.LeakyReLU(0.2)
                self.fc2 = nn.Linear(20, 1)
                nn.init.constant_(self.fc1.weight, 0.1)
                nn.init.constant_(self.fc1.bias, 0.0)
                nn.init.constant_(self.fc2.weight, 0.1)
                nn.init.constant_(self.fc2.bias, 0.0)
                self.fc1.weight.data[0, 0] = math.inf

            def forward(self, x):
                return self.fc2(self.act(self.fc1(x.flatten(1))))
    """)
    )
    code, _, err = run_cli(path, "--verify", "rgap", "--samples", "1")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "--verify rgap (R-GAP): the weight fc1.weight holds NaN or Inf before any op runs" in err


def test_finite_values_pass_without_a_second_run():
    model = nn.Linear(3, 2)

    def rerun():
        raise AssertionError("the locator must not run when everything is finite")

    output = model(torch.ones(1, 3))
    finite.require_finite(
        "x", output, list(model.parameters()), model=model, rerun=rerun, parameters=list(model.parameters())
    )
    assert finite.all_finite({"a": torch.ones(2), "b": [torch.zeros(1)]})
    assert not finite.all_finite({"a": torch.ones(2), "b": [torch.tensor([float("nan")])]})
    assert finite.all_finite(torch.tensor([1, 2]))  # integer tensors hold no NaN


def test_the_sketch_itself_is_checked_before_its_svd():
    """A finite shared gradient whose derivative in x is not: sqrt at 0 (the gradient reads sqrt(x), ∂g/∂x reads
    its infinite slope)."""
    from rankaudit.verify.rank import jacobian as rank

    class Curved(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(torch.sqrt(x))

    torch.manual_seed(0)
    with pytest.raises(finite.NonFiniteError) as error:
        rank.measure(Curved(), torch.zeros(1, 4), torch.tensor([0]))
    assert error.value.exit_code == 3 and "derivative of the shared gradient is not finite" in str(error.value)
