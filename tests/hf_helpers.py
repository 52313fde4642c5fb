"""Offline Hugging Face fixtures: a byte-level BPE tokenizer trained in memory (with or without a chat template)
and tiny random Llama-family models, saved to folders and loaded back as a user's download would be."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "What is 12 + 7? Let us add: 12 + 7 = 19. The answer is 19.\nProblem Solution user assistant\n" * 20


def save_tokenizer(folder, chat_template: bool, vocab_size: int = 300):
    """A byte-level BPE with <s>, </s>, <pad>, saved with save_pretrained into `folder`; returns the loaded one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))
