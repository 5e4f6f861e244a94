"""Issue 22: readable output on big models: repeated layer rows and caveats grouped (-v lists all), plurals right,
ρ printed as the percentage the rest of the report prints."""

from __future__ import annotations

import re
import textwrap

import pytest
from conftest import EXAMPLES

from rankaudit.report.table import MAX_TABLE_ROWS
from rankaudit.report.table_findings import SHOWN_NAMES
from rankaudit.settings.levels import count, percent

BLOCKS = 45
# Forty-five identical blocks, each with a LayerNorm and a GELU (neither modelled: two RA101 caveats a block).
DEEP_MLP = f"""
import torch.nn as nn

INPUT_SHAPE = (16,)


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range({BLOCKS}))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""


@pytest.fixture
def deep(tmp_path):
    path = tmp_path / "deep.py"
    path.write_text(DEEP_MLP)
    return path


def test_repeated_rows_and_caveats_collapse_and_v_lists_them(run_cli, deep):
    code, out, _ = run_cli(deep, "--fail-on", "never")
    assert code == 0
    lines = out.splitlines()
    rows = [line for line in lines if re.match(r"^[ >] +blocks\.\d+\.0 ", line)]
    assert len(rows) == 1 and "blocks.0.0" in rows[0]  # the first block's Linear only
    assert f"   ... {BLOCKS - 1} more rows, blocks.1.0 to blocks.{BLOCKS - 1}.0, each repeating a row above" in out
    assert any(re.match(r"^[ >] +head +Linear", line) for line in lines)  # a row unlike the others stays
    caveats = 2 * BLOCKS
    assert f"Caveats ({caveats}, grouped by rule and op; -v lists each):" in out
    groups = [line for line in lines if line.startswith("  RA101 × ")]
    assert len(groups) == 2
    assert groups[0].startswith(
        f"  RA101 × {BLOCKS} (blocks.0.1, blocks.1.1, blocks.2.1 and {BLOCKS - SHOWN_NAMES} "
        "more): LayerNorm is not modelled"
    )
    assert len(lines) < 30

    _, verbose, _ = run_cli(deep, "--fail-on", "never", "-v")
    assert len([line for line in verbose.splitlines() if re.match(r"^[ >] +blocks\.\d+\.0 ", line)]) == BLOCKS
    assert len([line for line in verbose.splitlines() if line.startswith("  RA101 blocks.")]) == caveats
    assert "more rows" not in verbose and "grouped" not in verbose


def test_a_short_table_is_printed_whole(run_cli):
    _, out, _ = run_cli(EXAMPLES / "cnn6.py", "--fail-on", "never")
    assert "more rows" not in out and len(re.findall(r"^[ >] +conv\d ", out, re.M)) == 6
    assert MAX_TABLE_ROWS >= 30


LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

INPUT_SHAPE = (16,)
INPUT_DTYPE = torch.long
CONFIG = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers={layers},
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=0, eos_token_id=0)


class DeepLlama(LlamaForCausalLM):
    def __init__(self):
        super().__init__(CONFIG)
"""


def test_a_many_block_llm_prints_under_sixty_lines(run_cli, tmp_path):
    """The issue's 3.4 B-parameter LLM printed 681 lines (315 caveats); the same architecture from a tiny config
    with 8 blocks prints about 90 layer rows and 42 caveats in full, under 60 lines by default."""
    pytest.importorskip("transformers", reason="needs transformers, not installed (pip install -e '.[test]')")
    path = tmp_path / "deep_llama.py"
    path.write_text(textwrap.dedent(LLAMA.format(layers=8)))
    code, out, _ = run_cli(path)
    assert code == 1  # exposed, the token set too
    assert len(out.splitlines()) < 60
    assert "Caveats (42, grouped by rule and op; -v lists each):" in out
    assert re.search(r"  RA101 × 17 \(model\.layers\.0\.input_layernorm, .* and 14 more\): LlamaRMSNorm", out)
    assert "more rows, model.layers.1." in out
    _, verbose, _ = run_cli(path, "-v")
    assert len(verbose.splitlines()) > 120 and "model.layers.7.mlp.down_proj" in verbose


@pytest.mark.parametrize(
    "number, word, expected",
    [(1, "step", "1 step"), (2, "step", "2 steps"), (1000, "step", "1,000 steps"), (0, "client", "0 clients")],
)
def test_counts_have_the_right_plural(number, word, expected):
    assert count(number, word) == expected


def test_round_lines_print_rho_as_the_percentage(run_cli):
    """cnn6 at N = 64, B = 4, C = 2: the round as a whole is capped by the update's 125,456 values of 393,216
    unknowns, ρ = 31.9 %, written the same way on both lines."""
    code, out, _ = run_cli(
        EXAMPLES / "cnn6.py", "--local-samples", "64", "--batch-size", "4", "--clients", "2", "--fail-on", "never"
    )
    round_line = next(line for line in out.splitlines() if line.startswith("Round: rank <="))
    whole_line = next(line for line in out.splitlines() if line.startswith("The round as a whole:"))
    assert "= 125,456, ρ = 31.9 %:" in round_line
    assert "rank <= 125,456 of 393,216 (31.9 %)" in whole_line
    assert percent(0.9996) == "99.96 %"


def test_round_refusal_says_one_step_and_one_client(run_cli):
    code, _, err = run_cli(EXAMPLES / "lenet.py", "--local-samples", "2", "--verify", "gdbr")
    assert code == 2 and "the update of 2 local steps from 1 client" in err and "(s)" not in err
