"""Offline Hugging Face fixtures (the tests never reach the hub): tiny random configs saved and loaded back like a
downloaded model, and a byte-level BPE tokenizer trained in memory, with or without a chat template."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

VOCAB = 96


def tiny_config(model_type: str, vocab: int = VOCAB, **llama):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if model_type == "llama":
        return LlamaConfig(**common, **llama)
    if model_type == "mistral":
        return MistralConfig(**common, sliding_window=4)
    if model_type == "qwen2":
        return Qwen2Config(**common)
    if model_type == "qwen3":
        return Qwen3Config(**common, head_dim=8)
    if model_type == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    raise ValueError(model_type)


def saved_tiny_model(model_type: str, folder, seed: int = 0, vocab: int = VOCAB) -> str:
    """A tiny random model of `model_type` written with save_pretrained into `folder`; returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab))
    if model_type == "qwen2":  # biases are zero-initialised: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if model_type == "gpt2":  # its biases too (and a trained GPT-2's are not zero)
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.bias.normal_(0, 0.5)
                block.attn.c_proj.bias.normal_(0, 0.5)
    if model_type == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return str(folder)


def load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def same_model(a, b) -> None:
    """Two causal LMs compute the same function: logits within float32 round-off, and equal greedy generations."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, atol=1e-5, rtol=0)
    greedy = lambda m: m.generate(ids[:1, :4], max_new_tokens=20, do_sample=False, pad_token_id=0, use_cache=True)  # noqa: E731
    assert torch.equal(greedy(a), greedy(b))


def saved_tokenizer(folder, texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained in memory and saved as a tokenizer folder (tokenizer.json) beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return str(folder)


class ParamsDump(Callback):
    """Saves every rank's parameters at the end of fit (test only; given to the CLI by class path)."""

    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        state = {k: v.detach().cpu().clone() for k, v in pl_module.named_parameters()}
        torch.save(state, f"{self.out}/params_{trainer.global_rank}.pt")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "What is 12 + 7? Let us add: 12 + 7 = 19. The answer is 19.\nProblem Solution user assistant\n" * 20


def instruct_tokenizer(folder, chat_template: bool, vocab_size: int = 300):
    """A byte-level BPE with <s>, </s>, <pad> (and a chat template if asked) for instruction data, saved with
    save_pretrained into `folder`; returns the loaded tokenizer."""
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


class RotaryWatch(Callback):
    """Listed after GrowAttentionCallback: at each batch start where a layer's query/key width changed since the last
    batch end (a growth in between), records whether its rotary columns came through bit-identical (test only)."""

    def __init__(self, out: str):
        self.out, self.before, self.growths = out, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.before = [(f.w_q.detach().clone(), f.w_k.detach().clone()) for f in self._forms(pl_module)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        forms = self._forms(pl_module)
        if self.before is not None and any(f.d_head != q.shape[-1] for f, (q, _) in zip(forms, self.before)):
            self.growths.append([(q.shape[-1], f.d_head, torch.equal(f.w_q[..., :f.rotary], q[..., :f.rotary])
                                  and torch.equal(f.w_k[..., :f.rotary], k[..., :f.rotary]))
                                 for f, (q, k) in zip(forms, self.before)])

    def on_train_end(self, trainer, pl_module):
        torch.save(self.growths, f"{self.out}/rotary_watch.pt")

    @staticmethod
    def _forms(pl_module):
        return [named.form for named in pl_module.growable_forms()]
