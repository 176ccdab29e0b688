"""DTAGRPOTrainer vs TRL's GRPOTrainer: the training part of one optimizer step (loss and backward), side by side.

Both trainers load the same model and take the same generated batch (generated once by the stock trainer:
``_prepare_inputs``, TRL's generation, rewards and advantages); then, alternating A/B per repeat so the drift of
a shared machine hits both alike, the stock trainer runs TRL's loss and ``accelerator.backward`` over the
batch's micro-batches, and DTAGRPOTrainer its tree step (``_tree_step``). Generation is the same code in both and
is reported separately. The gradients of the two are compared too (float32: TRL's kernel vs the tree walk).

    python benchmarks/trl_step_time.py [--repeats 5] [--prompt 384] [--completion 48] [--threads 2]

Needs ``pip install -e ".[trl]"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch


def build(path: str, vocab: int, prompt_tokens: int, completion: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    # the bench's model (BENCHMARKS.md, "CPU: the default run"): 4 layers, hidden 256, vocab 2048
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=682, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=prompt_tokens + completion + 8,
                                 pad_token_id=0, eos_token_id=1, bos_token_id=2)).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=384, help="prompt tokens (shared by a group)")
    parser.add_argument("--completion", type=int, default=48, help="max completion tokens")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["HF_HUB_OFFLINE"] = "1"
    warnings.simplefilter("ignore")
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    from lightning_dta.integrations.trl import DTAGRPOTrainer

    vocab = 2048
    path = tempfile.mkdtemp(prefix="trl_bench_")
    build(path, vocab, args.prompt, args.completion)
    rng = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(t)}" for t in torch.randint(4, vocab, (args.prompt,), generator=rng))
               for _ in range(args.prompts)]
    rows = args.prompts * args.generations
    config = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows // args.micro_batches,
                  gradient_accumulation_steps=args.micro_batches, num_generations=args.generations,
                  max_completion_length=args.completion, use_cpu=True, report_to=[], bf16=False, fp16=False,
                  gradient_checkpointing=False, max_steps=1, temperature=1.0, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def make(cls):
        return cls(model=path, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                   args=trl.GRPOConfig(**config), train_dataset=Dataset.from_dict({"prompt": prompts * 8}),
                   processing_class=tokenizer)

    stock, dta = make(trl.GRPOTrainer), make(DTAGRPOTrainer)
    dta.model.load_state_dict(stock.model.state_dict())
    batch = next(iter(stock.get_train_dataloader()))
    stock.model.train(), dta.model.train()
    start = time.perf_counter()
    window = [stock._prepare_inputs(batch) for _ in range(args.micro_batches)]
    generation = time.perf_counter() - start
    for trainer in (stock, dta):
        trainer.current_gradient_accumulation_steps = args.micro_batches

    def stock_step() -> None:
        for inputs in window:
            stock.accelerator.backward(stock.compute_loss(stock.model, inputs))

    def dta_step() -> None:
        dta._tree_step(dta.model, window)

    times: dict[str, list[float]] = {"GRPOTrainer": [], "DTAGRPOTrainer": []}
    grads = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, trainer, step in (("GRPOTrainer", stock, stock_step), ("DTAGRPOTrainer", dta, dta_step)):
            trainer.model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed)
            grads[name] = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    error = max(float((grads["DTAGRPOTrainer"][n] - g).norm() / g.norm()) for n, g in grads["GRPOTrainer"].items()
                if g.norm() > 0)
    stats = dta.dta_last_step.metrics
    print(f"workload: {args.prompts} prompts x {args.generations} completions, prompt {args.prompt} tokens, "
          f"completions <= {args.completion} (mean {stats['logical_tokens'] / rows - args.prompt:.1f}), "
          f"{args.micro_batches} micro-batches; tree: logical {stats['logical_tokens']:.0f} tokens, tree "
          f"{stats['tree_tokens']:.0f}, C = {stats['compression_ratio']:.2f}; threads {args.threads}")
    print(f"generation of the batch (the same in both): {generation:.2f} s")
    for name, values in times.items():
        print(f"{name:15s} loss + backward: median {statistics.median(values):.3f} s  "
              f"(min {min(values):.3f}, max {max(values):.3f}, {len(values)} repeats)")
    ratio = statistics.median(times["GRPOTrainer"]) / statistics.median(times["DTAGRPOTrainer"])
    print(f"ratio GRPOTrainer / DTAGRPOTrainer: {ratio:.2f}x; max relative gradient difference {error:.1e} "
          "(float32: TRL's chunked kernel vs the tree walk)")


if __name__ == "__main__":
    main()
