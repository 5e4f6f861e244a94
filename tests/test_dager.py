"""DAGER's condition: the static span finding on language models, and --verify dager recovering the tokens exactly
where (and only where) the finding says so. Tiny configs from examples/, CPU, seeded."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXAMPLES
from torch import nn

pytest.importorskip("transformers", reason="needs transformers, not installed (pip install -e '.[test]')")

from rankaudit.audit import audit
from rankaudit.count.calls import trace_and_count
from rankaudit.errors import UsageError
from rankaudit.findings import leakage
from rankaudit.model.load import load_model
from rankaudit.report import sarif, table
from rankaudit.trace.inputs import input_specs
from rankaudit.verify.attacks import dager, dager_call, dager_check, dager_span

SEQUENCE = 16
D_MODEL = 128
GPT2, BERT, LLAMA, LORA = (
    str(EXAMPLES / name) for name in ("gpt2_tiny.py", "bert_tiny.py", "llama_tiny.py", "gpt2_lora_tiny.py")
)


class Subject:
    """One example traced once on meta and built once with real float64 weights."""

    def __init__(self, spec: str):
        loaded = load_model(spec, (SEQUENCE,), device="meta")
        self.traced = trace_and_count(
            loaded.module, (SEQUENCE,), input_dtype=loaded.input_dtype, forward_kwargs=loaded.forward_kwargs
        )
        torch.manual_seed(0)
        model = load_model(spec, (SEQUENCE,), device="cpu").module.double().eval()
        self.call = dager_call.forward_call(model, input_specs(model, (SEQUENCE,), torch.long), loaded.forward_kwargs)
        self.vocabulary = loaded.vocab_size

    def finding(self, batch_size: int, shared=None):
        return leakage.token_leakage(self.traced, batch_size, shared)

    def attack(self, batch_size: int, *, extend: bool = False, seed: int = 0):
        """DAGER on the layers the finding names, with the pooling the runner uses; (outcome, precision, recall)."""
        tokens = self.finding(batch_size)
        sent = [layer for layer in tokens.layers if layer.shared and layer.trainable]
        group = [layer.name for layer in sent if layer.reads == sent[0].reads]
        outcome = dager.run_dager(
            self.call,
            group,
            batch_size=batch_size,
            positions=SEQUENCE,
            vocab_size=self.vocabulary,
            position_dependent=sent[0].position_dependent,
            device="cpu",
            seed=seed,
            extend=extend,
        )
        true = {token for token, _ in outcome.true_pairs}
        found = {token for token, _, _ in outcome.passed}
        precision = len(true & found) / len(found) if found else 0.0
        return outcome, precision, len(true & found) / len(true)


@pytest.fixture(scope="module")
def gpt2():
    return Subject(GPT2)


@pytest.fixture(scope="module")
def bert():
    return Subject(BERT)


@pytest.fixture(scope="module")
def llama():
    return Subject(LLAMA)


def test_gpt2_finding_names_the_fused_projection_with_its_budget(gpt2):
    tokens = gpt2.finding(2)
    (layer,) = tokens.layers  # c_proj and the MLP read attention's output: no per-token function of the token
    assert (layer.name, layer.d_in, layer.d_out, layer.tokens_per_batch) == (
        "transformer.h.0.attn.c_attn",
        128,
        384,
        32,
    )
    assert layer.position_dependent and layer.candidates == 2000 * SEQUENCE  # wte + wpe before ln_1
    assert layer.exposed and tokens.span_exposed
    assert "the token set of the batch can be read from this layer's gradient by a span test" in layer.reason
    assert (tokens.safe_tokens_per_batch, tokens.safe_batch_size) == (D_MODEL, D_MODEL // SEQUENCE)


def test_gpt2_tokens_and_sequences_recovered_exactly_well_below_d(gpt2):
    outcome, precision, recall = gpt2.attack(2, extend=True)
    assert (precision, recall) == (1.0, 1.0)
    assert outcome.basis.rank == 2 * SEQUENCE and outcome.causal
    assert outcome.extension["exact_sequence_rate"] == 1.0 and outcome.extension["sequences"] == 2
    assert outcome.nearest_rejected > 100 * dager_span.DISTANCE_THRESHOLD  # no candidate near the threshold


@pytest.mark.parametrize("batch_size", [7, 8, 10])
def test_gpt2_recovery_and_static_finding_flip_at_the_same_point(gpt2, batch_size):
    """B·n = 112 < 128: exact; 128 and 160: the span fills what the layer reads and every candidate passes."""
    _, precision, recall = gpt2.attack(batch_size)
    exact = precision == 1.0 and recall == 1.0
    assert gpt2.finding(batch_size).span_exposed == exact == (batch_size * SEQUENCE < D_MODEL)
    if not exact:
        assert recall == 1.0 and precision < 0.1  # the batch's ~100 tokens among all 2,000


@pytest.mark.parametrize("batch_size", [2, 10])
def test_bert_token_set_the_same_way(bert, batch_size):
    outcome, precision, recall = bert.attack(batch_size)
    exposed = bert.finding(batch_size).span_exposed
    assert [layer.name.rsplit(".", 1)[-1] for layer in bert.finding(batch_size).layers] == ["query", "key", "value"]
    assert not outcome.causal
    if batch_size == 2:
        assert exposed and (precision, recall) == (1.0, 1.0)
    else:
        assert not exposed and recall == 1.0 and precision < 0.1


def test_withholding_the_first_block_turns_the_finding_off(gpt2):
    tokens = gpt2.finding(2, shared={"transformer.wte", "transformer.h.1.attn.c_attn", "lm_head"})
    assert not tokens.span_exposed and tokens.safe_tokens_per_batch is None
    assert "withheld" in tokens.layers[0].reason


def test_lora_adapters_alone_expose_the_tokens():
    subject = Subject(LORA)
    tokens = subject.finding(2)
    assert not tokens.exposed  # the embedding is frozen: its rows are never sent
    status = {layer.name.split("c_attn.")[-1]: (layer.trainable, layer.exposed) for layer in tokens.layers}
    assert status == {"base_layer": (False, False), "lora_A.default": (True, True), "lora_B.default": (True, True)}
    # lora_A is 128 -> 64: its gradient spans the batch's vectors while B·n <= 64 (the rank r), and no further.
    assert tokens.safe_tokens_per_batch == 65
    outcome, precision, recall = subject.attack(2, extend=True)
    assert (precision, recall) == (1.0, 1.0) and outcome.extension["exact_sequence_rate"] == 1.0
    assert any("LoRA's B to zero" in note for note in outcome.notes)
    first_block = {layer.name for layer in tokens.layers if ".h.0." in layer.name}
    withheld = subject.finding(2, shared={layer.name for layer in tokens.layers} - first_block)
    assert not withheld.span_exposed


def test_llama_position_free_vectors_and_pooled_projections(llama):
    """Llama adds no position embedding: one candidate per token. k_proj and v_proj (128 -> 64, grouped-query
    attention) are exposed at B·n = 80 only together with q_proj; the query at position 0 attends to itself alone,
    so ∇W_q misses each sequence's first token and the pooled test needs k and v."""
    subject = llama
    tokens = subject.finding(5)
    assert {layer.name.rsplit(".", 1)[-1]: layer.exposed for layer in tokens.layers} == {
        "q_proj": True,
        "k_proj": True,
        "v_proj": True,
    }
    assert all(not layer.position_dependent and layer.candidates == 2000 for layer in tokens.layers)
    alone = subject.finding(5, shared={"model.layers.0.self_attn.k_proj"})
    assert not alone.span_exposed  # 80 > 64: one rank-64 gradient keeps part of the span only
    outcome, precision, recall = subject.attack(2, extend=True)
    assert (precision, recall) == (1.0, 1.0) and outcome.candidates_tested == 2000
    assert outcome.extension["exact_sequence_rate"] == 1.0


def test_repeated_tokens_keep_a_position_free_batch_exposed_at_b_n_equal_d(llama):
    """B·n = 128 = d: the finding says not exposed, if the 128 vectors are distinct. Position-free vectors repeat
    with every repeated token; this seed's batch holds fewer than 128 distinct tokens, so the test still reads the
    token set exactly, and the verification explains the agreement."""
    subject = llama
    tokens = subject.finding(8)
    assert not tokens.span_exposed and tokens.safe_tokens_per_batch == D_MODEL
    outcome, precision, recall = subject.attack(8)
    distinct = len({token for token, _ in outcome.true_pairs})
    assert distinct < D_MODEL and outcome.basis.rank == distinct and (precision, recall) == (1.0, 1.0)
    summary = dager_check.dager_summary(outcome, [layer for layer in tokens.layers], 8, 2000, "random", "cpu", 0.0)
    assert summary["expected_exposed"] and summary["confirms"] and summary["distinct_vectors"] == distinct
    assert summary["pair_precision"] is None  # positions carry nothing here


class ThreeAdapters(nn.Module):
    """Token and position embeddings, a LayerNorm, and three rank-4 maps reading its output (q, k, v adapters)."""

    def __init__(self, vocabulary: int = 300, width: int = 32, length: int = 5):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(length, width))
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = nn.Linear(width, 4), nn.Linear(width, 4), nn.Linear(width, 4)
        self.head = nn.Linear(12, vocabulary)

    def forward(self, ids):
        x = self.norm(self.embedding(ids) + self.position)
        return self.head(torch.cat([torch.tanh(self.q(x)), self.k(x), self.v(x)], dim=-1))


def test_layers_reading_the_same_vectors_pool_their_gradients():
    with torch.device("meta"):
        model = ThreeAdapters()
    traced = trace_and_count(model, (5,), input_dtype=torch.long)
    tokens = leakage.token_leakage(traced, 2, None)  # B·n = 10 > 4 for each map, <= 12 together
    # The head reads the three maps' outputs side by side (a cat): not followed, so not listed.
    assert [(layer.name, layer.exposed) for layer in tokens.layers] == [("q", True), ("k", True), ("v", True)]
    assert tokens.safe_tokens_per_batch == 13
    assert not leakage.token_leakage(traced, 2, {"q", "head"}).span_exposed
    torch.manual_seed(0)
    real = ThreeAdapters().double()
    call = dager_call.LanguageModelCall(real, "ids", True)
    for group, exact in ((["q", "k", "v"], True), (["q"], False)):
        outcome = dager.run_dager(
            call, group, batch_size=2, positions=5, vocab_size=300, position_dependent=True, device="cpu", seed=1
        )
        true = {token for token, _ in outcome.true_pairs}
        found = {token for token, _, _ in outcome.passed}
        assert (found == true) == exact


def test_span_test_distances_and_rank_tolerance():
    generator = torch.Generator().manual_seed(0)
    vectors = torch.randn(6, 20, generator=generator, dtype=torch.float64)
    gradient = vectors.T @ torch.randn(6, 30, generator=generator, dtype=torch.float64)  # Σ_t x_t δ_tᵀ
    basis = dager_span.span_basis(gradient)
    assert basis.rank == 6 and basis.first_dropped < basis.tolerance < basis.last_kept
    inside = vectors.T @ torch.randn(6, 3, generator=generator, dtype=torch.float64)
    outside = torch.randn(20, 3, generator=generator, dtype=torch.float64)
    assert dager_span.span_distances(basis.basis, inside.T).max() < 1e-7
    assert dager_span.span_distances(basis.basis, outside.T).min() > 0.3


def test_cli_reports_the_finding_and_the_verification(run_cli, tmp_path):
    report = tmp_path / "report.html"
    code, out, err = run_cli(
        GPT2, "--input-shape", str(SEQUENCE), "-b", "2", "--verify", "dager", "--format", "json", "--html", report
    )
    assert code == 1, err
    payload = json.loads(out)
    tokens = payload["token_leakage"]
    assert tokens["span_exposed"] and tokens["safe_tokens_per_batch"] == D_MODEL and tokens["safe_batch_size"] == 8
    assert tokens["layers"][0]["exposed"] and tokens["layers"][0]["d_in"] == D_MODEL
    assert any("by a span test" in reason for reason in payload["policy"]["reasons"])
    result = payload["verification"]["dager"]
    assert (result["token_precision"], result["token_recall"], result["exact_sequence_rate"]) == (1.0, 1.0, 1.0)
    assert result["confirms"] and result["rank"] == 32 and result["device"] == "cpu"
    assert result["candidates_tested"] == 2000 * SEQUENCE
    page = report.read_text()
    assert '-tokens">Token leakage' in page and "Verification: DAGER on the gradient of" in page
    assert "<dd>100.0%</dd>" in page and "<dd>2 / 2</dd>" in page  # precision, recall; exact sequences


def test_sarif_table_and_policy_follow_the_finding():
    result = audit(GPT2, input_shape=(SEQUENCE,), batch_size=2)
    rules = {finding["ruleId"] for finding in sarif.to_sarif([result])["runs"][0]["results"]}
    assert "RA006" in rules
    text = table.render([result])
    assert "DAGER's span test): exposed." in text and "Safe budget: at least 128 tokens" in text
    never = audit(GPT2, input_shape=(SEQUENCE,), batch_size=2, fail_on="never")
    assert never.policy.passed
    withheld = audit(
        GPT2, input_shape=(SEQUENCE,), batch_size=2, withheld_layers=["transformer.wte", "transformer.h.0.attn.c_attn"]
    )
    assert not withheld.token_leakage.span_exposed
    assert "RA006" not in {f["ruleId"] for f in sarif.to_sarif([withheld])["runs"][0]["results"]}
    assert not any("span test" in reason for reason in withheld.policy.reasons)
    with pytest.raises(UsageError, match="no shared, trainable layer reads per-token vectors"):
        dager_check.verify_tokens(withheld, GPT2, show_progress=False)


def _basis_for(subject: Subject, layer: str, batch_size: int = 2):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(subject.vocabulary, (batch_size, SEQUENCE), generator=generator)
    module = subject.call.model.get_submodule(layer)
    subject.call.model.zero_grad(set_to_none=True)
    logits = subject.call.logits(ids)
    logits.pow(2).mean().backward()
    gradient, _ = dager.group_gradient(subject.call, [module], [layer], ids)
    subject.call.model.zero_grad(set_to_none=True)
    return module, dager_span.span_basis(gradient).basis, ids


def test_layer_norm_shortcut_matches_running_each_pair_through_the_model(gpt2):
    module, basis, ids = _basis_for(gpt2, "transformer.h.0.attn.c_attn")
    norm = gpt2.call.model.get_submodule("transformer.h.0.ln_1")
    tests = [
        dager_span.span_test_vocabulary(
            gpt2.call,
            module,
            basis,
            vocab_size=gpt2.vocabulary,
            positions=SEQUENCE,
            position_dependent=True,
            device="cpu",
            norm=given,
        )
        for given in (norm, None)
    ]
    assert "closed form" in tests[0].method and "through the model" in tests[1].method
    pairs = [{(token, position) for token, position, _ in test.accepted} for test in tests]
    true = {(int(token), position) for row in ids for position, token in enumerate(row.tolist())}
    assert pairs[0] == pairs[1] and true <= pairs[0]
    # Token 1840 sits at position 2 of one sequence and 6 of the other: with ln_1's bias at zero (its
    # initialisation) LayerNorm only rescales a centred sum, so LN(e_v + p_6) lies in the span of LN(e_v + p_2),
    # LN(e_1840 + p_6), LN(e_1840 + p_2) for the batch's v at position 2 or 6. The extra pairs carry true tokens.
    assert {token for token, _ in pairs[0]} == {token for token, _ in true}
    assert tests[0].nearest_rejected == pytest.approx(tests[1].nearest_rejected, rel=1e-9)


class TanhBeforeNorm(nn.Module):
    """Not a LayerNorm of (token part + position part): tanh sits between the sum and the norm."""

    def __init__(self, vocabulary: int = 200, width: int = 24, length: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(length, width))
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids):
        return self.head(self.q(self.norm(torch.tanh(self.embedding(ids) + self.position))))


def test_the_shortcut_declines_when_its_check_fails():
    torch.manual_seed(0)
    model = TanhBeforeNorm().double()
    call = dager_call.LanguageModelCall(model, "ids", True)
    outcome = dager.run_dager(
        call, ["q"], batch_size=1, positions=4, vocab_size=200, position_dependent=True, device="cpu", norm="norm"
    )
    assert "through the model" in outcome.method
    assert {(t, p) for t, p, _ in outcome.passed} == outcome.true_pairs


def test_suggest_lists_the_safe_token_budget(run_cli):
    code, out, err = run_cli(
        "suggest", GPT2, "--input-shape", str(SEQUENCE), "-b", "2", "--top", "1", "--format", "json"
    )
    assert code == 0, err
    payload = json.loads(out)
    assert payload["token_span_exposed"] == ["transformer.h.0.attn.c_attn"]
    assert (payload["tokens_per_batch"], payload["safe_tokens_per_batch"], payload["safe_token_batch"]) == (32, 128, 8)
