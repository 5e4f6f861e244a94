"""GPT-2 tiny (examples/gpt2_tiny.py's config) fine-tuned with LoRA (peft): only the adapters' gradients are sent."""

import torch
from gpt2_tiny import CONFIG
from peft import LoraConfig, get_peft_model
from transformers import GPT2LMHeadModel

# Per sequence: 16 token ids.
INPUT_SHAPE = (16,)
INPUT_DTYPE = torch.long
# PeftModel.forward takes **kwargs, so rankaudit cannot see that it accepts use_cache: say it here.
FORWARD_KWARGS = {"use_cache": False}

# Rank-64 adapters on every block's fused q/k/v projection (c_attn, a Conv1D: fan_in_fan_out). The base weights
# and the embeddings are frozen, so the embedding table's gradient is never sent; the adapters' A matrices read
# the same per-token vectors as c_attn does.
LORA = LoraConfig(r=64, lora_alpha=64, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)

model = get_peft_model(GPT2LMHeadModel(CONFIG), LORA)
