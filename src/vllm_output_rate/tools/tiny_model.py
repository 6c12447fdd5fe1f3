"""The embedded default model: a tiny random-weight Llama, made locally.

No model can be downloaded on the machines this project targets, so the
project writes its own: a 2-layer Llama (hidden 128, head_dim 64 -- the CPU
attention backend rejects 16) with seeded random weights and a byte-level BPE
tokenizer trained on a fixed built-in text, plus a chat template.  Output is
gibberish; timing is real.  The same call always writes the same weights and
tokenizer.

A second shape, ``bench`` (8 layers, hidden 512, about 28 M parameters), is
for end-to-end throughput benchmarks: its forward pass takes long enough on
CPU that the engine, not the HTTP front end, limits throughput, as on a real
deployment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SEED = 1234

#: Model shapes by name: (hidden, intermediate, layers, attention heads, KV heads).
SIZES = {
    "tiny": (128, 256, 2, 2, 1),
    "bench": (512, 1536, 8, 8, 2),
}
VOCAB_SIZE = 1024
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}"
    "{{ message['content'] if message['content'] is string else '' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A fixed, varied English text: the tokenizer's training corpus.
_CORPUS_SEED_TEXT = """
Continuous batching lets one engine serve many users at once. Every step the
scheduler decides which requests get a token. A user who opens many streams
can take most decode slots and slow everyone else down. Output tokens are paced
per user: a generic cell rate algorithm keeps one theoretical arrival time for
each user and releases one token every interval. Prompt tokens are free; only
generated tokens count. When the quota is spent the request pauses and resumes
later; it is never truncated and never rejected. Other users proceed normally.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor
jugs. How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
0 1 2 3 4 5 6 7 8 9 10 100 1000 tokens per second, milliseconds, bytes, blocks.
Hello! How are you today? Explain continuous batching in simple words, please.
Write a short poem about rivers, mountains, clouds and the sea at night.
"""


def _corpus() -> list[str]:
    lines = [line.strip() for line in _CORPUS_SEED_TEXT.strip().splitlines()]
    words = " ".join(lines).split()
    # Deterministic variations give the trainer enough pairs to merge.
    out = list(lines)
    for shift in range(1, 40):
        out.append(" ".join(words[shift:] + words[:shift]))
    return out


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_model(out_dir: str | os.PathLike, size: str = "tiny") -> Path:
    """Write the model of shape ``size`` (config, safetensors weights, tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(SIZES)}")
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,  # head_dim = hidden / heads = 64
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # generation_config from save_pretrained may carry sampling defaults;
    # keep vLLM's defaults by writing only the token ids.
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
            indent=2,
        )
        + "\n"
    )
    return out


def is_tiny_model_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and (p / "tokenizer.json").is_file() and any(
        p.glob("*.safetensors")
    )


#: Layers a tiny LoRA adapter changes, and the PEFT format's key prefix.
LORA_TARGETS = ("q_proj", "v_proj")
_PEFT_PREFIX = "base_model.model.model.layers"


def write_tiny_lora(
    out_dir: str | os.PathLike, model_dir: str | os.PathLike, rank: int = 8, seed: int = SEED
) -> Path:
    """Write a random LoRA adapter for the tiny model in ``model_dir``, in PEFT's format.

    ``adapter_config.json`` plus ``adapter_model.safetensors`` with one
    ``lora_A`` (rank x in) and ``lora_B`` (out x rank) pair for the query and
    value projections of every layer: what ``vllm serve --enable-lora
    --lora-modules NAME=DIR`` loads.  Different seeds give different adapters;
    the same seed always the same one.  Made without ``peft``.
    """
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in LORA_TARGETS:
            key = f"{_PEFT_PREFIX}.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=generator) * 0.02
            b = torch.randn(out_features[module], rank, generator=generator) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
