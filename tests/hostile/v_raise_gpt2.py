"""Hostile: a tiny GPT-2 whose blocks raise on their second real batch (DAGER's runs go through them)."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

INPUT_SHAPE = (8,)
INPUT_DTYPE = torch.long


class RaisingGPT2(GPT2LMHeadModel):
    def __init__(self):
        super().__init__(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=100,
                                    bos_token_id=0, eos_token_id=0))
        self.real_calls = 0
        self.lm_head.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        if isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            self.real_calls += 1
            if self.real_calls >= 2:
                raise RuntimeError("batch 2 is cursed")
