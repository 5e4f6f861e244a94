"""Real third-party models from tiny configs (built offline): each loads, traces and counts like forward hooks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest
import torch
from conftest import EXAMPLES, REPO
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="needs transformers, not installed (pip install -e '.[test]')"
)
from transformers.pytorch_utils import Conv1D  # noqa: E402

REAL_BATCH = 2
COUNTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)
COUNTED_OPS = {"Linear", "Conv1d", "Conv2d", "Conv3d", "Conv1D"}

# name -> (model class, config class, config keyword arguments, kind). Sizes are tiny: the whole file runs on
# two shared CPU cores.
MODELS = {
    "bert": (
        "BertForSequenceClassification",
        "BertConfig",
        dict(
            vocab_size=500,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
        "text",
    ),
    "distilbert": (
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        dict(vocab_size=500, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64),
        "text",
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=500, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0),
        "text",
    ),
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=500,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        "text",
    ),
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        dict(vocab_size=500, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        "text",
    ),
    "vit": (
        "ViTForImageClassification",
        "ViTConfig",
        dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
        ),
        "image",
    ),
    "swin": (
        "SwinForImageClassification",
        "SwinConfig",
        dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3),
        "image",
    ),
    "convnext": (
        "ConvNextForImageClassification",
        "ConvNextConfig",
        dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32, num_labels=3),
        "image",
    ),
    "resnet": (
        "ResNetForImageClassification",
        "ResNetConfig",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3),
        "image",
    ),
}
TEXT = [name for name, spec in MODELS.items() if spec[3] == "text"]
IMAGES = [name for name, spec in MODELS.items() if spec[3] == "image"]
EMBEDDING = {
    "bert": "bert.embeddings.word_embeddings",
    "distilbert": "distilbert.embeddings.word_embeddings",
    "gpt2": "transformer.wte",
    "llama": "model.embed_tokens",
    "t5": "encoder.embed_tokens",
}


def _config(name: str):
    model_class, config_class, kwargs, _ = MODELS[name]
    return getattr(transformers, model_class), getattr(transformers, config_class)(**kwargs)


def _model_file(tmp_path, name: str, sequence: int = 16) -> str:
    model_class, config_class, kwargs, kind = MODELS[name]
    shape = f"({sequence},)" if kind == "text" else "(3, 32, 32)"
    dtype = "torch.long" if kind == "text" else "torch.float32"
    path = tmp_path / f"{name}_tiny.py"
    path.write_text(
        textwrap.dedent(f"""
        import torch
        from transformers import {model_class}, {config_class}
        INPUT_SHAPE = {shape}
        INPUT_DTYPE = {dtype}
        model = {model_class}({config_class}(**{kwargs!r}))
    """)
    )
    return str(path)


def _analyse(run_cli, path: str, *args: str) -> tuple[int, dict]:
    code, out, err = run_cli(path, "--format", "json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


def _counted_rows(payload: dict) -> dict[str, list[tuple[int, int, int]]]:
    """Rows by module, each call's (|x|, |W|, |z|); a folded shortcut projection (method.md: counting) has no row of its own:
    its |W| is the difference between its block's first row's weights and own weights."""
    rows = defaultdict(list)
    for row in payload["layers"]:
        if row["op"] in COUNTED_OPS:
            rows[row["name"].split("#")[0]].append((row["inputs"], row["own_weights"], row["outputs"]))
        for folded in row["folded"]:
            rows[folded].append(("folded", row["weights"] - row["own_weights"], "folded"))
    return dict(rows)


def _as_counted(hooked: dict, payload: dict) -> dict:
    """Hook measurements as the rows hold them: a folded projection shows its |W| only."""
    folded = {name for row in payload["layers"] for name in row["folded"]}
    return {
        name: [("folded", w, "folded") for _, w, _ in calls] if name in folded else calls
        for name, calls in hooked.items()
    }


def _hooked_rows(name: str, sequence: int = 16) -> dict[str, list[tuple[int, int, int]]]:
    """|x|, |W|, |z| per sample of every Linear/Conv call on a real forward pass with random weights."""
    model_class, config = _config(name)
    torch.manual_seed(0)
    model = model_class(config).eval()
    measured = defaultdict(list)

    def hook(module_name):
        def record(module, inputs, output):
            # Per sample: windowed attention folds windows into dimension 0, so divide by the real batch.
            trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
            measured[module_name].append((inputs[0].numel() // REAL_BATCH, trainable, output.numel() // REAL_BATCH))

        return record

    for module_name, module in model.named_modules():
        if isinstance(module, COUNTED):
            module.register_forward_hook(hook(module_name))
    with torch.no_grad():
        if MODELS[name][3] == "text":
            ids = torch.randint(0, config.vocab_size, (REAL_BATCH, sequence))
            extra = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
            model(input_ids=ids, use_cache=False, **extra) if "use_cache" in _parameters(model) else model(
                input_ids=ids, **extra
            )
        else:
            model(torch.rand(REAL_BATCH, 3, 32, 32))
    return dict(measured)


def _parameters(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


@pytest.mark.parametrize("name", IMAGES)
def test_image_models_count_like_forward_hooks(run_cli, tmp_path, name):
    _, payload = _analyse(run_cli, _model_file(tmp_path, name))
    assert payload["build"] == "meta-parameters"
    assert payload["inputs"][0]["role"] == "data" and payload["inputs"][0]["unknowns"] == 3 * 32 * 32
    assert payload["token_leakage"] is None
    hooked = _as_counted(_hooked_rows(name), payload)
    if name == "vit":
        # The class token is a parameter, not input: it joins the patches (cat) without unknowns (method.md: counting), so the
        # first block's projections see 16 patches x 32 unknowns, not the 17 x 32 entries a hook measures.
        for projection in ("q_proj", "k_proj", "v_proj"):
            ((x, w, z),) = hooked[f"vit.layers.0.attention.{projection}"]
            hooked[f"vit.layers.0.attention.{projection}"] = [(x - 32, w, z)]
    assert _counted_rows(payload) == hooked


@pytest.mark.parametrize("name", TEXT)
def test_text_models_start_at_the_embedding_and_count_like_hooks_at_two_lengths(run_cli, tmp_path, name):
    _, config = _config(name)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or config.dim
    for sequence in (8, 16):
        code, payload = _analyse(run_cli, _model_file(tmp_path, name, sequence))
        tokens = payload["inputs"][0]
        assert (tokens["role"], tokens["dtype"], tokens["unknowns_at"]) == ("tokens", "int64", EMBEDDING[name])
        assert tokens["unknowns"] == sequence * hidden  # B x n x d at B = 1: the embedding's output
        assert payload["identifiability"]["unknowns"] == sequence * hidden
        assert _counted_rows(payload) == _as_counted(_hooked_rows(name, sequence), payload)
        leakage = payload["token_leakage"]
        assert leakage["exposed"] and leakage["tokens_per_batch"] == sequence
        assert [e["name"] for e in leakage["embeddings"]] == [EMBEDDING[name]]
        assert code == 1 and any("token set is exposed" in reason for reason in payload["policy"]["reasons"])


@pytest.mark.parametrize("name", TEXT)
def test_withholding_the_embedding_turns_token_leakage_off(run_cli, tmp_path, name):
    _, payload = _analyse(run_cli, _model_file(tmp_path, name, 8), "--withheld-layers", EMBEDDING[name])
    leakage = payload["token_leakage"]
    assert not leakage["exposed"] and not leakage["embeddings"][0]["shared"]
    assert not any("token set" in reason for reason in payload["policy"]["reasons"])


def test_encoder_decoder_feeds_the_same_ids_to_the_decoder(run_cli, tmp_path):
    _, payload = _analyse(run_cli, _model_file(tmp_path, "t5"), "-b", "2")
    decoder = next(info for info in payload["inputs"] if info["name"] == "decoder_input_ids")
    # The decoder looks the same ids up in the same table: the same unknowns, counted once.
    assert decoder["unknowns_at"] == "encoder.embed_tokens" and decoder["unknowns"] == 0
    assert payload["identifiability"]["unknowns"] == 2 * 16 * 32
    assert "decoder_input_ids=input_ids" in payload["forward_kwargs"]
    assert "use_cache=False" in payload["forward_kwargs"]


def test_gpt2_example_prints_rows_from_the_token_embedding_and_the_finding(run_cli):
    code, out, err = run_cli(EXAMPLES / "gpt2_tiny.py", "-v")
    assert code == 1, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("layer"))
    assert lines[header + 1].split()[:2] == ["transformer.wte", "Embedding"]
    assert "unknowns start here" in lines[header + 1] and lines[header + 1].split()[4] == str(32 * 128)
    assert "input 32 token ids (int64)" in lines[0]
    assert "Token leakage: exposed by the embedding's gradient: transformer.wte" in out and "use_cache=False" in out
    assert "Built with parameters on the meta device" in out


def test_tied_embedding_rows_of_the_batch_stand_out_on_a_real_gradient():
    """What the tied-embedding finding claims: with GPT-2's lm_head tied to wte, the rows of the tokens the loss
    depends on have a far larger gradient norm than every other row."""
    model_class, config = _config("gpt2")
    torch.manual_seed(1)
    model = model_class(config)
    ids = torch.randint(0, config.vocab_size, (REAL_BATCH, 16))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    norms = model.transformer.wte.weight.grad.norm(dim=1)
    used = torch.unique(ids[:, :-1])  # a causal LM's last token reaches no loss through the embedding
    others = torch.ones(config.vocab_size, dtype=torch.bool)
    others[torch.unique(ids)] = False
    assert norms[used].min() > 20 * norms[others].max()


def test_several_inputs_with_a_mask_that_carries_no_unknowns(run_cli, tmp_path):
    path = _model_file(tmp_path, "bert")
    with open(path) as handle:
        text = handle.read().replace(
            "INPUT_SHAPE = (16,)", 'INPUT_SHAPE = {"input_ids": (16,), "attention_mask": (16,)}'
        )
    with open(path, "w") as handle:
        handle.write(text)
    _, payload = _analyse(run_cli, path)
    assert payload["input_shape"] == {"input_ids": [16], "attention_mask": [16]}
    roles = {info["name"]: (info["role"], info["unknowns"]) for info in payload["inputs"]}
    assert roles == {"input_ids": ("tokens", 16 * 32), "attention_mask": ("mask", 0)}
    assert payload["identifiability"]["unknowns"] == 16 * 32


def test_regnet_style_constructor_computes_with_tensors(run_cli):
    """examples/regnet_tiny.py computes its stage widths with torch arithmetic and .tolist(): all meta would fail."""
    code, out, err = run_cli(EXAMPLES / "regnet_tiny.py", "--format", "json")
    assert code in (0, 1), err
    payload = json.loads(out)
    assert payload["build"] == "meta-parameters"
    sys.path.insert(0, str(EXAMPLES))
    try:
        import regnet_tiny
    finally:
        sys.path.remove(str(EXAMPLES))
    model = regnet_tiny.RegNetTiny().eval()
    measured = defaultdict(list)
    for module_name, module in model.named_modules():
        if isinstance(module, COUNTED):
            module.register_forward_hook(
                lambda m, i, o, n=module_name: measured[n].append(
                    (i[0].numel() // REAL_BATCH, sum(p.numel() for p in m.parameters()), o.numel() // REAL_BATCH)
                )
            )
    model(torch.rand(REAL_BATCH, 3, 32, 32))
    rows = {
        r["name"]: (r["inputs"], r["own_weights"], r["outputs"]) for r in payload["layers"] if r["op"] in COUNTED_OPS
    }
    projections = {name for name in measured if name.endswith(".proj.0")}  # folded into their block's first layer
    assert rows == {name: calls[0] for name, calls in measured.items() if name not in projections}


CONSTRUCTOR_READS_A_WEIGHT = """
import torch.nn as nn
INPUT_SHAPE = (4,)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.scale = float(self.fc.weight.abs().sum().item())
    def forward(self, x):
        return self.fc(x)
"""


def test_a_constructor_reading_weight_values_gets_the_truth(run_cli, tmp_path):
    path = tmp_path / "reads_weight.py"
    path.write_text(CONSTRUCTOR_READS_A_WEIGHT)
    code, _, err = run_cli(path)
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "could not build Net()" in err and "item()" in err and "reads_weight.py:8" in err
    assert "builds with plain PyTorch" in err and "make the file importable" not in err


def test_a_file_that_fails_on_its_own_is_told_so(run_cli, tmp_path):
    path = tmp_path / "broken_import.py"
    path.write_text("import torch\nwidths = torch.arange(3).tolist()\nraise RuntimeError('needs a GPU')\n")
    code, _, err = run_cli(path)
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "RuntimeError: needs a GPU" in err and "fails with plain PyTorch too" in err
    assert "broken_import.py:3" in err


def test_forward_kwargs_from_the_model_file_reach_forward(run_cli, tmp_path):
    path = tmp_path / "switch.py"
    path.write_text(
        textwrap.dedent("""
        import torch.nn as nn
        INPUT_SHAPE = (8,)
        FORWARD_KWARGS = {"wide": True}
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.narrow, self.broad = nn.Linear(8, 2), nn.Linear(8, 6)
            def forward(self, x, wide=False, return_dict=False):
                out = self.broad(x) if wide else self.narrow(x)
                return {"logits": out, "extra": self.narrow(x)} if return_dict else out
    """)
    )
    _, payload = _analyse(run_cli, str(path), "-v")
    assert [row["name"] for row in payload["layers"]] == ["broad"]  # only the logits' path is counted
    assert payload["forward_kwargs"] == ["return_dict=True", "wide=True"]


def test_ten_billion_parameter_benchmark_model_builds_without_weights():
    # VmHWM, not ru_maxrss: Linux carries the parent's high-water mark into ru_maxrss across the exec, and by the
    # time this runs the pytest process holds gigabytes of cached rank sketches.
    probe = (
        "import re\nfrom rankaudit.model.load import load_model\n"
        "m = load_model('benchmarks/models/mlp_10b.py')\n"
        "parameters = list(m.module.parameters())\n"
        "peak = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
        "print(m.build, sum(p.numel() for p in parameters), all(p.is_meta for p in parameters), peak)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    build, parameters, all_meta, max_rss_kib = done.stdout.split()
    assert build == "meta-parameters" and int(parameters) > 10_000_000_000 and all_meta == "True"
    assert int(max_rss_kib) < 1.5 * 1024 * 1024


TOKEN_MODEL = """
import torch
import torch.nn as nn
INPUT_SHAPE = (6,)
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.position = nn.Parameter(torch.zeros(1, 6, 8))
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)
    def forward(self, ids):
        return self.fc(self.norm(self.embed(ids) + self.position))
"""


def test_input_dtype_option_on_the_fx_path(run_cli, tmp_path):
    path = tmp_path / "tagger.py"
    path.write_text(TOKEN_MODEL)
    code, _, err = run_cli(path)
    assert code == 3 and "--input-dtype int64" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(path, "--input-dtype", "int64", "--format", "json", "-b", "3")
    payload = json.loads(out)
    assert payload["tracer"] == "torch.fx" and payload["inputs"][0]["unknowns_at"] == "embed"
    fc = next(row for row in payload["layers"] if row["name"] == "fc")
    assert (fc["inputs"], fc["weights"], fc["outputs"]) == (3 * 6 * 8, 27, 3 * 6 * 3)
    leakage = payload["token_leakage"]
    assert leakage["exposed"] and leakage["tokens_per_batch"] == 18
    assert leakage["embeddings"][0]["vocab_size"] == 50 and leakage["embeddings"][0]["tied_with"] == []


def test_sarif_has_the_token_rule(run_cli):
    code, out, _ = run_cli(EXAMPLES / "gpt2_tiny.py", "--format", "sarif")
    run = json.loads(out)["runs"][0]
    rules = {rule["id"]: rule for rule in run["tool"]["driver"]["rules"]}
    assert rules["RA005"]["name"] == "token-set-exposed"
    token = [r for r in run["results"] if r["ruleId"] == "RA005"]
    assert len(token) == 1 and token[0]["properties"]["embeddings"] == ["transformer.wte"]


def test_direct_params_name_what_each_op_reads():
    from rankaudit.count.calls import trace_and_count

    class ClassToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 8)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
            self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
            self.norm = nn.LayerNorm(8)
            self.scale = nn.Parameter(torch.ones(8), requires_grad=False)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            x = self.proj(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
            return self.head((self.norm(x) * self.scale)[:, 0])

    with torch.device("meta"):
        model = ClassToken()
    traced = trace_and_count(model, (3, 4))
    direct = {record.op: record.direct_params for record in traced.records.values()}
    assert direct["cat"] == [("cls_token", 8)]  # through the untraced expand
    assert direct["add"] == [("pos_embed", 32)]
    assert direct["LayerNorm"] == [("norm.weight", 8), ("norm.bias", 8)]
    assert direct["mul"] == [("scale", 0)]  # frozen: no gradient to share
    assert traced.input_ids == [traced.input_id]


def test_a_peft_wrapper_gets_the_wrapped_models_switches(run_cli, tmp_path):
    """PeftModel.forward takes **kwargs: use_cache=False must still reach GPT-2 underneath, without FORWARD_KWARGS."""
    model = tmp_path / "lora.py"
    model.write_text(
        "import torch\nfrom peft import LoraConfig, get_peft_model\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "INPUT_SHAPE = (16,)\nINPUT_DTYPE = torch.long\n"
        "def build():\n"
        "    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=100,\n"
        "                                      bos_token_id=0, eos_token_id=0))\n"
        "    return get_peft_model(base, LoraConfig(r=4, target_modules=['c_attn'], fan_in_fan_out=True))\n"
    )
    code, out, err = run_cli(f"{model}:build", "--format", "json")
    assert code in (0, 1), err
    payload = json.loads(out)
    assert payload["forward_kwargs"] == ["use_cache=False"]
    assert payload["identifiability"]["unknowns"] == 16 * 32


# How users write a Hugging Face model: through the module's attributes (import transformers as tf), an Auto
# class, a factory, a subclass. The classes load lazily, at build time, when the file's import is over.
HF_SPELLINGS = {
    "gpt2-attribute": (
        "gpt2",
        "model = tf.GPT2LMHeadModel(tf.GPT2Config(**{kwargs!r}))",
        "",
    ),
    "llama-factory": (
        "llama",
        "def build():\n    return tf.LlamaForCausalLM(tf.LlamaConfig(**{kwargs!r}))",
        ":build",
    ),
    "bert-auto": (
        "bert",
        "def build():\n    return tf.AutoModelForSequenceClassification.from_config(tf.BertConfig(**{kwargs!r}))",
        ":build",
    ),
    "distilbert-subclass": (
        "distilbert",
        "class Classifier(tf.DistilBertForSequenceClassification):\n"
        "    def __init__(self):\n        super().__init__(tf.DistilBertConfig(**{kwargs!r}))",
        "",
    ),
    "gpt2-auto-causal-lm": (
        "gpt2",
        "def build():\n    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model('gpt2', **{kwargs!r}))",
        ":build",
    ),
}


# The second Auto spelling runs with the slow cases: each spelling is a fresh process that imports transformers.
@pytest.mark.parametrize(
    "spelling", [*HF_SPELLINGS][:-1] + [pytest.param("gpt2-auto-causal-lm", marks=pytest.mark.slow)]
)
def test_hugging_face_models_through_attributes_and_auto_classes(tmp_path, spelling):
    """In a fresh process, as a user runs it: transformers decides which optional packages exist when it is first
    imported, and this test process imported it long ago."""
    name, body, suffix = HF_SPELLINGS[spelling]
    path = tmp_path / f"{spelling.replace('-', '_')}.py"
    source = "import transformers as tf\nINPUT_SHAPE = (8,)\nINPUT_DTYPE = 'int64'\n"
    path.write_text(source + body.format(kwargs=MODELS[name][2]) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "rankaudit", f"{path}{suffix}", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    code, payload = done.returncode, json.loads(done.stdout or "{}")
    assert code == 1, done.stderr
    tokens = payload["inputs"][0]
    assert (tokens["role"], tokens["unknowns_at"]) == ("tokens", EMBEDDING[name])
    assert payload["token_leakage"]["exposed"]
    assert [e["name"] for e in payload["token_leakage"]["embeddings"]] == [EMBEDDING[name]]
    assert payload["stand_ins"] == []  # nothing the file imports is missing: no stand-in answered anyone
    assert code == 1
