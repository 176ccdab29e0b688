"""One padded batch, two computations: their loss on the padded [rows, completion tokens] grid and our tree walk
over the same rollouts, each differentiated down to the same model's parameters (float64).

The batch is what a GRPO step holds: groups of completions sharing a prompt (a system prefix shared by every
group), right-padded completions of different lengths, one completion that trains nothing (a truncated answer
masked out), and per-token log-probs near the model's own: ``behaviour`` (the inference engine's), ``recomputed``
(the trainer's at the start of the step) and ``ref``. Each framework's names for these map to our ``Rollout``
fields through the converter's ``rollout_fields``, so the mapping is tested too.

The model is a tiny GPT-2 in float64: its layer norms compute in float64 (Llama's and Qwen's RMSNorm upcast to
float32 even in a float64 model, which limits any two computations of their gradients to ~1e-7), so the tree
walk and the padded batch agree to ~1e-15 and the tests hold them to 1e-9, far below any semantic difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_dta as dta

VOCAB = 40
THEIR_NAMES = {  # each framework's per-token tensors -> the batch's
    "sampling_per_token_logps": "behaviour", "old_per_token_logps": "recomputed", "ref_per_token_logps": "ref",
    "rollout_log_probs": "behaviour", "old_log_prob": "recomputed", "ref_log_prob": "ref",
    "logprobs": "behaviour", "prox_logp": "recomputed",
}


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return GPT2LMHeadModel(config).to(torch.float64).eval()


def save_model_dir(path: str, model: torch.nn.Module) -> str:
    """``model`` and a word-level tokenizer (``t4`` .. ``t39``) in ``path``: what TRL's trainers load by path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(path)
    model.save_pretrained(path)
    return path


@dataclass
class PaddedBatch:
    prompts: list[list[int]]
    completions: torch.Tensor  # [B, T] long, 0 after each row's length
    lengths: list[int]  # completion tokens present in each row
    mask: torch.Tensor  # [B, T] float64: the trained completion tokens
    advantages: torch.Tensor  # [B] float64
    behaviour: torch.Tensor  # [B, T] float64 (0 off the mask)
    recomputed: torch.Tensor
    ref: torch.Tensor
    groups: list[int]

    @property
    def rows(self) -> int:
        return len(self.prompts)


def logp_and_entropy(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable per-token log-probs and entropies ``[B, T]`` of the completions under softmax(logits / T),
    one ordinary padded forward (right padding, so positions are the rows' own)."""
    width = max(len(p) for p in batch.prompts) + batch.completions.shape[1]
    ids = torch.zeros(batch.rows, width, dtype=torch.long)
    attention = torch.zeros(batch.rows, width, dtype=torch.long)
    for i, (prompt, n) in enumerate(zip(batch.prompts, batch.lengths)):
        row = prompt + batch.completions[i, :n].tolist()
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
    log_probs = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits / temperature, dim=-1)
    logp = torch.zeros(batch.completions.shape, dtype=torch.float64)
    entropy = torch.zeros(batch.completions.shape, dtype=torch.float64)
    rows = [i for i, n in enumerate(batch.lengths) for _ in range(n)]
    cols = [t for n in batch.lengths for t in range(n)]
    index = torch.tensor([len(batch.prompts[i]) - 1 + t for i, t in zip(rows, cols)])
    r, c = torch.tensor(rows), torch.tensor(cols)
    picked = log_probs[r, index]
    logp = logp.index_put((r, c), picked.gather(1, batch.completions[r, c][:, None])[:, 0])
    entropy = entropy.index_put((r, c), -(picked.exp() * picked).sum(-1))
    return logp, entropy


def make_batch(model: torch.nn.Module, seed: int = 0, groups: int = 3, per_group: int = 4, width: int = 7,
               temperature: float = 1.0, noise: float = 0.25) -> PaddedBatch:
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(4)]
    prompts, rows, lengths, group_of = [], [], [], []
    for g in range(groups):
        prompt = system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))]
        for _ in range(per_group):
            n = rng.randint(2, width)
            prompts.append(prompt)
            rows.append([rng.randrange(1, VOCAB) for _ in range(n)] + [0] * (width - n))
            lengths.append(n)
            group_of.append(g)
    completions = torch.tensor(rows)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    mask[1] = 0.0  # a truncated completion, masked out: it trains nothing but is a row of the batch
    batch = PaddedBatch(prompts, completions, lengths, mask, torch.zeros(len(rows), dtype=torch.float64),
                        mask.clone(), mask.clone(), mask.clone(), group_of)
    with torch.no_grad():
        current, _ = logp_and_entropy(model, batch, temperature)
    gen = torch.Generator().manual_seed(seed)

    def near(base: torch.Tensor, scale: float) -> torch.Tensor:
        return ((base + scale * torch.randn(base.shape, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
                * (mask > 0))

    batch.recomputed = near(current, noise)
    batch.behaviour = near(batch.recomputed, noise)
    batch.ref = near(current, 2 * noise)
    batch.advantages = torch.randn(len(rows), generator=gen, dtype=torch.float64)
    return batch


def rollouts(batch: PaddedBatch, rollout_fields: dict[str, str], token_advantages: torch.Tensor | None = None
             ) -> list[dta.Rollout]:
    """The batch as rollouts, their per-token tensors in our fields as the converter maps them."""
    out = []
    for i, prompt in enumerate(batch.prompts):
        n, p = batch.lengths[i], len(prompt)
        ids = prompt + batch.completions[i, :n].tolist()
        fields = {}
        for theirs, ours in rollout_fields.items():
            name = THEIR_NAMES.get(theirs)
            if name is None:  # the mask: always the batch's
                continue
            values = getattr(batch, name)  # one of the batch's three log-prob tensors
            fields[ours] = [0.0] * p + values[i, :n].tolist()
        advantages = float(batch.advantages[i]) if token_advantages is None else \
            [0.0] * p + token_advantages[i, :n].tolist()
        out.append(dta.Rollout(input_ids=ids, loss_mask=[0] * p + batch.mask[i, :n].long().tolist(),
                               advantages=advantages, group_id=batch.groups[i], **fields))
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def tree_step(model: torch.nn.Module, rollouts: list[dta.Rollout], converted) -> tuple[float, dict]:
    """Our side: the converted loss over the prefix tree of the rollouts, DFS, the converter's engine options."""
    model.zero_grad(set_to_none=True)
    out = dta.tree_backward(model, dta.PrefixTree.from_rollouts(rollouts), converted.loss, **converted.engine)
    return out.loss, grads(model)


def assert_same(ours: tuple[float, dict], theirs: tuple[float, dict], rtol: float = 1e-9, atol: float = 0.0) -> None:
    """Loss to ``rtol`` (or ``atol``: a loss that cancels to ~0, whose inputs carry float32 errors) and every
    parameter's gradient to ``rtol`` relative."""
    (loss, mine), (their_loss, their_grads) = ours, theirs
    assert abs(loss - their_loss) <= max(rtol * max(abs(their_loss), 1e-3), atol), (loss, their_loss)
    assert set(mine) == set(their_grads)
    for name, expected in their_grads.items():
        error = float((mine[name] - expected).norm()) / max(float(expected.norm()), 1e-30)
        assert error <= rtol, f"{name}: relative gradient error {error:.2e} > {rtol:.0e}"


def generation_steps(rollouts: list[dta.Rollout], converted, seed: int = 0) -> list[list[dta.Rollout]]:
    """Our pipeline on one generation batch, as the data module's iterable source runs it: the converted estimator
    over the whole batch, then the converted ``generation`` split into its optimizer steps (in training order)."""
    from lightning_dta.contracts import ModelLimits
    from lightning_dta.lightning.sources import IterableSteps

    source = IterableSteps([rollouts], converted.advantage_estimator, converted.advantage_options,
                           converted.generation, seed)
    return [step for _, step in source.steps(0, 0, ModelLimits())]


def sgd_update(model: torch.nn.Module, gradients: dict[str, torch.Tensor], lr: float) -> None:
    """One optimizer step between the two compared steps (the same on both sides): ``p -= lr * g``."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in gradients:
                parameter -= lr * gradients[name]


def relative_gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest per-parameter relative gradient difference (what ``assert_same`` bounds)."""
    return max(float((ours[n] - g).norm()) / max(float(g.norm()), 1e-30) for n, g in theirs.items())


def subset(batch: PaddedBatch, index: list[int]) -> PaddedBatch:
    """The rows ``index`` of ``batch`` (one optimizer step of a generation batch)."""
    return PaddedBatch([batch.prompts[i] for i in index], batch.completions[index],
                       [batch.lengths[i] for i in index], batch.mask[index], batch.advantages[index],
                       batch.behaviour[index], batch.recomputed[index], batch.ref[index],
                       [batch.groups[i] for i in index])


def rows_of(step: list[dta.Rollout], batch: PaddedBatch) -> list[int]:
    """Which rows of ``batch`` the rollouts of ``step`` are (by their tokens and group)."""
    rows: dict = {}
    for i, prompt in enumerate(batch.prompts):
        rows.setdefault((batch.groups[i], tuple(prompt + batch.completions[i, :batch.lengths[i]].tolist())),
                        []).append(i)
    return [rows[(r.group_id, tuple(r.input_ids))].pop(0) for r in step]
