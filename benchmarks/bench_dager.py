#!/usr/bin/env python3
"""Benchmark of --verify dager's span test at GPT-2 small's sizes: a 50,000-token vocabulary, d = 768.

Run from the repository root:

    python benchmarks/bench_dager.py [--batch 4] [--length 32] [--vocab 50000] [--blocks 2] [--device auto]
                                     [--through-model] [--out FILE.json]

Target: the span test over the whole vocabulary under 60 s on the project's CPUs and under 5 s on a GPU.
Two models at GPT-2 small's width (d = 768, 12 heads) with a 50,000-token vocabulary, random weights, float64,
`--blocks` blocks (the test reads the first block: depth changes the gradient's cost, not the test's):
  - GPT-2: a position embedding is added before ln_1, so every (token, position) pair is a candidate
    (vocab x length vectors); --verify dager tests them through LayerNorm(token part + position part) in closed
    form, checked against the model on random pairs (`--through-model` also times running each pair through it);
  - Llama: RMSNorm of the token's embedding alone, so one vector per token, each run through the model; q, k and v
    pooled.
One client batch of `--batch` sequences of `--length` random tokens gives the real gradient; the timed span test is
everything after the backward pass: the SVD, every candidate's vector and its distance to the span. Precision and
recall against the batch's true tokens are printed beside the time, so a fast wrong answer cannot pass.
This is a benchmark, not a test: it exits 0 and prints PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.verify.attacks import dager, dager_call, dager_span
from rankaudit.verify.model import resolve_device  # noqa: E402

CPU_TARGET_S, GPU_TARGET_S = 60.0, 5.0
WIDTH = 768


def build(kind: str, vocab: int, blocks: int, length: int, seed: int, device: str):
    """GPT-2 (token + position embedding, then ln_1) or Llama (RMSNorm of the token's embedding alone) at GPT-2
    small's width, random weights, float64; how to call it, the attacked layers and the norm they read."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=WIDTH,
            n_head=12,
            n_layer=blocks,
            n_positions=max(1024, length),
            bos_token_id=0,
            eos_token_id=0,
        )
        model, layers, norm = (
            transformers.GPT2LMHeadModel(config),
            ["transformer.h.0.attn.c_attn"],
            "transformer.h.0.ln_1",
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=WIDTH,
            intermediate_size=2048,
            num_hidden_layers=blocks,
            num_attention_heads=12,
            num_key_value_heads=12,
            max_position_embeddings=max(1024, length),
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.LlamaForCausalLM(config)
        layers, norm = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], None
    model = model.double().eval().to(device)
    call = dager_call.LanguageModelCall(model, "input_ids", False, switches={"use_cache": False, "return_dict": True})
    return call, layers, norm


def client_gradient(call, layers: list[str], batch: int, length: int, vocab: int, seed: int, device: str):
    """The batch's ids and the attacked layers' gradients (pooled as --verify dager pools them), after a real
    backward pass of next-token cross-entropy."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, length + 1), generator=generator)
    inputs, targets = ids[:, :length].to(device), ids[:, 1:].to(device)
    call.model.zero_grad(set_to_none=True)
    logits = call.logits(inputs)
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()
    modules = [call.model.get_submodule(layer) for layer in layers]
    gradient, _ = dager.group_gradient(call, modules, layers, inputs)
    call.model.zero_grad(set_to_none=True)
    return inputs, modules[0], gradient


def timed_span_test(
    call, module, gradient, inputs, *, vocab: int, length: int, position_dependent: bool, norm, device: str
) -> dict:
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    basis = dager_span.span_basis(gradient)
    test = dager_span.span_test_vocabulary(
        call,
        module,
        basis.basis.to(device),
        vocab_size=vocab,
        positions=length,
        position_dependent=position_dependent,
        device=device,
        norm=norm,
    )
    synchronize()
    seconds = time.perf_counter() - started
    true = {int(t) for t in inputs.reshape(-1).tolist()}
    found = {token for token, _, _ in test.accepted}
    hits = len(true & found)
    return {
        "seconds": round(seconds, 3),
        "rank": basis.rank,
        "vectors": test.tested,
        "method": test.method,
        "precision": hits / len(found) if found else 0.0,
        "recall": hits / len(true),
        "nearest_rejected": test.nearest_rejected,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--through-model",
        action="store_true",
        help="also time GPT-2's pairs run through the model one by one (no LayerNorm shortcut)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    print(
        f"DAGER span test at GPT-2 small's width (d = {WIDTH}), vocabulary {args.vocab:,}, batch {args.batch} x "
        f"{args.length} tokens (B·n = {args.batch * args.length}), float64, {device} ({name}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    target = GPU_TARGET_S if device == "cuda" else CPU_TARGET_S
    rows = {}
    runs = [("gpt2", True, True), ("llama", False, False)]
    if args.through_model:
        runs.insert(1, ("gpt2", True, False))
    built = {}
    for kind, position_dependent, shortcut in runs:
        if kind not in built:
            started = time.perf_counter()
            call, layers, norm = build(kind, args.vocab, args.blocks, args.length, args.seed, device)
            seconds = time.perf_counter() - started
            started = time.perf_counter()
            inputs, module, gradient = client_gradient(
                call, layers, args.batch, args.length, args.vocab, args.seed, device
            )
            print(
                f"  {kind}: built in {seconds:.1f} s; the client batch's forward and backward "
                f"{time.perf_counter() - started:.2f} s; attacked {', '.join(layers)}"
            )
            built = {kind: (call, norm, inputs, module, gradient)}
        call, norm, inputs, module, gradient = built[kind]
        norm_module = call.model.get_submodule(norm) if norm and shortcut else None
        row = timed_span_test(
            call,
            module,
            gradient,
            inputs,
            vocab=args.vocab,
            length=args.length,
            position_dependent=position_dependent,
            norm=norm_module,
            device=device,
        )
        verdict = "PASS" if row["seconds"] < target and row["precision"] == row["recall"] == 1.0 else "FAIL"
        label = f"{kind} {'pairs' if position_dependent else 'tokens'}{'' if shortcut or not position_dependent else ' (through the model)'}"
        print(
            f"  {label:<30} {row['vectors']:>10,} vectors  {row['seconds']:7.2f} s  rank {row['rank']}  "
            f"precision {row['precision']:.3f}  recall {row['recall']:.3f}  nearest rejected "
            f"{row['nearest_rejected']:.3g}  (target < {target:g} s on {device}): {verdict}"
        )
        print(f"  {'':<30} {row['method']}")
        rows[label] = {**row, "verdict": verdict}
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": device,
                    "device_name": name,
                    "batch": args.batch,
                    "length": args.length,
                    "vocab": args.vocab,
                    "blocks": args.blocks,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
