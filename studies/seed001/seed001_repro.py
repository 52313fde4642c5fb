"""Seed 001's experiment in small, on CPU: a tiny Llama pretrained on Tiny Shakespeare, fine-tuned on the generated
arithmetic set as it is (mha), converted to low-rank DINT and to full DINT; 3 seeds.

Per run: instruction validation loss, exact-answer accuracy (greedy generation on held-out problems), attention
entropy per layer before and after fine-tuning on the same batches, and the Shakespeare validation loss after
fine-tuning (what the fine-tune cost the original domain; logged as val/shakespeare/loss).

    nice -n 10 env OMP_NUM_THREADS=1 PYTHONPATH=. python studies/seed001/seed001_repro.py \
        --text tinyshakespeare.txt --out runs/seed001
writes runs/seed001/results.json; README.md beside this file reports it. --quick runs a few steps of everything (smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lit_growattn.data import TextDataModule  # noqa: E402
from lit_growattn.data.arithmetic import ArithmeticDataModule, exact_answer_accuracy, make_rows  # noqa: E402
from lit_growattn.data.instruct import prompt_ids  # noqa: E402
from lit_growattn.hf.dint import DintSettings  # noqa: E402
from lit_growattn.dint.models import convert_to_dint  # noqa: E402
from lit_growattn.hf import HFCausalLM  # noqa: E402
from lit_growattn.dint.entropy import AttentionEntropyCallback, layer_entropies  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=True)
BATCH = 16
VARIANTS = {"mha": None, "lowrank_dint": DintSettings("lowrank", rank=4), "dint": DintSettings("full")}


def make_tokenizer(folder: Path, text: str, vocab_size: int):
    """A byte-level BPE trained on Shakespeare and arithmetic text, with <s>, </s>, <pad>, no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def trainer(out: Path, name: str, max_steps: int, val_every: int, callbacks=()) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=val_every,
                     check_val_every_n_epoch=None, limit_val_batches=8, log_every_n_steps=20, gradient_clip_val=1.0,
                     logger=TensorBoardLogger(str(out / "logs"), name=name), enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                     num_sanity_val_steps=0)


def optimizer(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[tuple[str, str]], max_new_tokens: int) -> float:
    """Greedy generation from each held-out prompt (left-padded batches, KV cache), exact answer compared."""
    model.eval()
    generations = []
    for start in range(0, len(problems), 50):
        chunk = problems[start:start + 50]
        prompts = [prompt_ids(tokenizer, p) for p, _ in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        generations += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return exact_answer_accuracy(generations, [answer for _, answer in problems])


def pretrain(out: Path, text: Path, tokenizer_dir: Path, steps: int) -> tuple[Path, float]:
    folder = out / "pretrained"
    data = TextDataModule(path=str(text), tokenizer=str(tokenizer_dir / "tokenizer.json"), block_size=128,
                          batch_size=BATCH, samples_per_epoch=steps * BATCH, cache_dir=str(out / "cache"))
    torch.manual_seed(0)
    module = HFCausalLM(config=dict(MODEL, vocab_size=data.vocab_size), growable=False, warmup_steps=50,
                        optimizer=optimizer(3e-3))
    fit = trainer(out, "pretrain", steps, steps)
    fit.fit(module, datamodule=data)
    module.model.save_pretrained(folder)
    return folder, float(fit.callback_metrics["val/loss"])


def finetune(out: Path, pretrained: Path, tokenizer_dir: Path, held_out_text: Path, variant: str, seed: int, steps: int,
             num_examples: int) -> dict:
    from transformers import AutoModelForCausalLM

    name = f"{variant}_seed{seed}"
    folder = out / "converted" / name
    native = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    (convert_to_dint(native, VARIANTS[variant], seed=seed) if VARIANTS[variant] else native).save_pretrained(folder)
    data = ArithmeticDataModule(str(tokenizer_dir), num_examples=num_examples, data_seed=0, val_size=200,
                                max_length=96, batch_size=BATCH, seed=seed, cache_dir=str(out / "cache"),
                                val_texts={"shakespeare": str(held_out_text)}, val_text_windows=16)
    L.seed_everything(seed)
    module = HFCausalLM(pretrained=str(folder), growable=False, warmup_steps=20, optimizer=optimizer(1e-3))
    entropy = AttentionEntropyCallback(num_batches=2)
    fit = trainer(out, name, steps, steps // 2, [entropy])
    start = time.monotonic()
    fit.fit(module, datamodule=data)
    seconds = time.monotonic() - start
    metrics = {k: float(v) for k, v in fit.callback_metrics.items()}
    after = layer_entropies(module.model.eval(), entropy._batches(fit, module.device))
    lam = [layer.self_attn.lam.abs().mean().item() for layer in module.model.model.layers] if VARIANTS[variant] else None
    return dict(variant=variant, seed=seed, val_loss=metrics["val/loss"], shakespeare_loss=metrics["val/shakespeare/loss"],
                accuracy=accuracy(module.model, data.tokenizer, data.held_out_problems(), 64),
                entropy_original=entropy.reference.tolist(), entropy_after=after.tolist(), mean_abs_lambda=lam,
                seconds=seconds)


def table(runs: list[dict]) -> str:
    """Markdown table: mean ± standard deviation over seeds per variant (entropy: mean over layers)."""
    import statistics

    def cell(values: list[float], digits: int) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"

    lines = ["| variant | seeds | instruction val loss | exact-answer accuracy | Shakespeare val loss after | "
             "entropy before → after (nats, mean over layers) | mean abs λ after |", "|---" * 7 + "|"]
    for variant in VARIANTS:
        rows = [r for r in runs if r["variant"] == variant]
        if not rows:
            continue
        before = [statistics.mean(r["entropy_original"]) for r in rows]
        after = [statistics.mean(r["entropy_after"]) for r in rows]
        lam = cell([statistics.mean(r["mean_abs_lambda"]) for r in rows], 4) if rows[0]["mean_abs_lambda"] else "—"
        lines.append(f"| {variant} | {len(rows)} | {cell([r['val_loss'] for r in rows], 3)} | "
                     f"{cell([r['accuracy'] for r in rows], 3)} | {cell([r['shakespeare_loss'] for r in rows], 2)} | "
                     f"{cell(before, 3)} → {cell(after, 3)} | {lam} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/seed001")
    parser.add_argument("--text", help="Tiny Shakespeare (tinyshakespeare.txt), the pretraining text")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pretrain_steps", type=int, default=400)
    parser.add_argument("--finetune_steps", type=int, default=250)
    parser.add_argument("--num_examples", type=int, default=4200)
    parser.add_argument("--quick", action="store_true", help="a few steps of everything")
    parser.add_argument("--from_run", help="reuse the tokenizer and pretrained model of this earlier --out")
    parser.add_argument("--table", help="print the table of an existing results.json and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["runs"]))
        return
    if args.quick:
        args.seeds, args.pretrain_steps, args.finetune_steps, args.num_examples = [0], 10, 4, 400
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_run:  # fine-tune the model pretrained by an earlier run (its tokenizer and held-out text too)
        base = Path(args.from_run)
        tokenizer_dir, pretrained, held_out = base / "tokenizer", base / "pretrained", base / "shakespeare_val.txt"
        pretrain_loss = json.loads((base / "results.json").read_text())["pretrain_val_loss"]
    else:
        if args.text is None:
            parser.error("pretraining needs the Tiny Shakespeare text: --text tinyshakespeare.txt (or --from_run DIR)")
        text = Path(args.text).read_text()
        held_out = out / "shakespeare_val.txt"
        held_out.write_text(text[int(len(text) * 0.9):])  # TextDataModule's default held-out tenth
        sample = text[: int(len(text) * 0.9)] + "".join(r["problem"] + "\n" + r["generated_solution"] + "\n"
                                                        for r in make_rows(2000, seed=99))
        tokenizer_dir = out / "tokenizer"
        make_tokenizer(tokenizer_dir, sample, 512)
        pretrained, pretrain_loss = pretrain(out, Path(args.text), tokenizer_dir, args.pretrain_steps)
    runs = []
    for seed in args.seeds:
        for variant in VARIANTS:
            runs.append(finetune(out, pretrained, tokenizer_dir, held_out, variant, seed, args.finetune_steps,
                                 args.num_examples))
            print(json.dumps(runs[-1]), flush=True)
            (out / "results.json").write_text(json.dumps(dict(vars(args), pretrain_val_loss=pretrain_loss, runs=runs),
                                                         indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
