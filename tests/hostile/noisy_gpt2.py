"""Hostile: the tiny GPT-2 of examples/gpt2_tiny.py, printing 2,000 lines at import and more in forward()."""
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

INPUT_SHAPE = (16,)
INPUT_DTYPE = torch.long
CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=200, bos_token_id=0, eos_token_id=0)

for line in range(2000):
    print(f"noise at import {line}")
os.write(1, b"written straight to fd 1\n")


class GPT2Noisy(GPT2LMHeadModel):
    def __init__(self):
        super().__init__(CONFIG)
        self.lm_head.register_forward_hook(lambda module, inputs, output: print("noise in forward"))
