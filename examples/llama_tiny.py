"""Llama from a small transformers config (built offline, random weights): token ids in, next-token logits out."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Per sequence: 16 token ids. Llama adds no position embedding before its first block (rotary positions act on
# q and k inside attention), so the first projections read RMSNorm(embedding) of the token alone.
INPUT_SHAPE = (16,)
INPUT_DTYPE = torch.long

# Grouped-query attention: 4 query heads share 2 key/value heads, so k_proj and v_proj map 128 -> 64.
CONFIG = LlamaConfig(
    vocab_size=2000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=0,
)


class LlamaTiny(LlamaForCausalLM):
    """Two blocks, d = 128, a vocabulary of 2,000: Llama's architecture at a size a test can run."""

    def __init__(self):
        super().__init__(CONFIG)
