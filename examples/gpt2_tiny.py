"""GPT-2 from a small transformers config (built offline, random weights): token ids in, next-token logits out."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

# Per sequence: 32 token ids. Token ids are no continuous unknowns: rankaudit starts the unknowns at the token
# embedding's output (32 x 128 per sequence) and reports whether the embedding's gradient gives the tokens away.
INPUT_SHAPE = (32,)
INPUT_DTYPE = torch.long

CONFIG = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=2000, bos_token_id=0, eos_token_id=0)


class GPT2Tiny(GPT2LMHeadModel):
    """Two blocks, d = 128, a vocabulary of 2,000: GPT-2's architecture at a size a test can run."""

    def __init__(self):
        super().__init__(CONFIG)
