"""BERT from a small transformers config (built offline, random weights): token ids in, two-class logits out."""

import torch
from transformers import BertConfig, BertForSequenceClassification

# Per sequence: 16 token ids. The first block's query/key/value projections read LayerNorm(word + position +
# segment embedding) of each token: a function of the token and its position alone, which DAGER's span test needs.
INPUT_SHAPE = (16,)
INPUT_DTYPE = torch.long

CONFIG = BertConfig(
    vocab_size=2000,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    max_position_embeddings=128,
    num_labels=2,
)


class BertTiny(BertForSequenceClassification):
    """Two blocks, d = 128, a vocabulary of 2,000: BERT's architecture at a size a test can run."""

    def __init__(self):
        super().__init__(CONFIG)
