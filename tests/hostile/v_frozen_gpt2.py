"""Hostile: a tiny GPT-2 whose every parameter is frozen: it shares no gradient, so DAGER has nothing to read."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

INPUT_SHAPE = (8,)
INPUT_DTYPE = torch.long


class FrozenGPT2(GPT2LMHeadModel):
    def __init__(self):
        super().__init__(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=100,
                                    bos_token_id=0, eos_token_id=0))
        for parameter in self.parameters():
            parameter.requires_grad_(False)
