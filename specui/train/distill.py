"""Draft distillation: build a small draft from the target (a few of its decoder layers,
its embeddings shared, a reduced head over the K most frequent answer tokens) and train it
to match the target's distribution (soft cross-entropy to the target's top-k, i.e. KL up
to a constant) along the target's own answers."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from specui.errors import SpecUIError
from specui.train.data import AnswerSet
from specui.train.states import padded_groups
from specui.weights.draft import EMBED_KEY, SpecUIDraftForCausalLM, stored_matrix


def choose_head_tokens(data: AnswerSet, size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids the draft may propose: `always` (EOS / end of turn), then the
    most frequent answer tokens, then the tokens carrying the most teacher top-k mass."""
    counts = Counter(t for answer in data.answer_ids for t in answer)
    mass: Counter = Counter()
    for ids, logp in zip(data.topk_ids, data.topk_logp):
        for tok, p in zip(ids.flatten().tolist(), logp.float().exp().flatten().tolist()):
            mass[tok] += p
    chosen = list(dict.fromkeys(always))
    for tok, _ in counts.most_common() + mass.most_common():
        if len(chosen) >= size:
            break
        if tok not in chosen:
            chosen.append(tok)
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def build_draft(target: PreTrainedModel, layers: list[int], head_tokens: torch.Tensor) -> SpecUIDraftForCausalLM:
    """A draft whose decoder layers, final norm and head rows start as the target's."""
    n = target.config.num_hidden_layers
    layers = [i % n for i in layers]
    config = copy.deepcopy(target.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    config.tie_word_embeddings = False
    config.specui_draft = {"head_size": len(head_tokens), "init_layers": layers, "target_layers": n}
    draft = SpecUIDraftForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for new, old in enumerate(layers):
            draft.model.layers[new].load_state_dict(target.model.layers[old].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        head = target.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head[head_tokens].float())
        draft.token_map.copy_(head_tokens)
    draft.model.embed_tokens = target.get_input_embeddings()  # shared with the target
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def grow_draft(draft: SpecUIDraftForCausalLM, target: PreTrainedModel, layers: list[int]) -> SpecUIDraftForCausalLM:
    """A deeper draft that computes exactly what `draft` computes: `layers` (target layer
    indices) must keep the draft's own layers (its init_layers) in their order; those keep
    their trained weights, and every other one starts as that target layer with its output
    projections (attention's o_proj, the MLP's down_proj) zeroed, so it adds nothing to the
    residual stream until training makes it useful. Head, norm and feature input are kept."""
    n = target.config.num_hidden_layers
    layers = [i % n for i in layers]
    old = [i % n for i in draft.config.specui_draft["init_layers"]]
    kept = [layers.index(i) for i in old if i in layers]
    if len(kept) != len(old) or kept != sorted(kept) or len(set(layers)) != len(layers) or len(layers) == len(old):
        raise SpecUIError(f"--layers {layers} must keep the draft's layers {old}, in their order, and add new ones")
    config = copy.deepcopy(draft.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        types = getattr(target.config, "layer_types", None) or config.layer_types
        config.layer_types = [types[i] for i in layers]
    config.specui_draft = {**config.specui_draft, "init_layers": layers}
    grown = SpecUIDraftForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for new, source in enumerate(layers):
            if source in old:
                grown.model.layers[new].load_state_dict(draft.model.layers[old.index(source)].state_dict())
                continue
            grown.model.layers[new].load_state_dict(target.model.layers[source].state_dict())
            grown.model.layers[new].self_attn.o_proj.weight.zero_()
            grown.model.layers[new].mlp.down_proj.weight.zero_()
        grown.model.norm.load_state_dict(draft.model.norm.state_dict())
        grown.lm_head.load_state_dict(draft.lm_head.state_dict())
        grown.token_map.copy_(draft.token_map)
        if draft.feature_fc is not None:
            grown.feature_fc.load_state_dict(draft.feature_fc.state_dict())
    grown.model.embed_tokens = draft.model.embed_tokens  # the target's, shared
    grown.model.embed_tokens.weight.requires_grad_(False)
    return grown


class _AsStored(torch.nn.Module):
    """Parametrization: the forward sees the weight as the draft will be stored (rounded to
    its 4-bit groups or int8 rows), the gradient reaches the float weight unchanged
    (straight-through)."""

    def __init__(self, key: str, layer_bits: int) -> None:
        super().__init__()
        self.key, self.layer_bits = key, layer_bits

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(weight, stored_matrix(self.key, weight, self.layer_bits).to(weight.dtype))


class _StraightThrough(torch.autograd.Function):
    """Forward: exactly `stored`; backward: the gradient goes to `weight` unchanged."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        return stored

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@contextmanager
def quantization_aware(draft: SpecUIDraftForCausalLM, layer_bits: int, on: bool = True) -> Iterator[int]:
    """Inside the block every stored matrix of the draft (the Linear weights: decoder layers,
    head, feature input) computes as save_draft will store it, so training fits the weights
    that ship and held-out probes measure them; afterwards the float weights are plain
    parameters again (save_draft rounds them exactly as seen here). Yields how many."""
    wrapped = []
    try:
        for name, module in draft.named_modules() if on else ():
            key = f"{name}.weight"
            if isinstance(module, torch.nn.Linear) and module.weight.requires_grad and key != EMBED_KEY:
                parametrize.register_parametrization(module, "weight", _AsStored(key, layer_bits))
                wrapped.append(module)
        yield len(wrapped)
    finally:
        for module in wrapped:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


@dataclass
class Batch:
    """Right-padded conversations (causal attention: padding after a sequence is harmless)."""

    input_ids: torch.Tensor  # (B, T)
    rows: torch.Tensor  # (N,) batch row of each answer position
    cols: torch.Tensor  # (N,) position whose hidden state predicts the answer token
    answer: torch.Tensor  # (N,) the target's token (vocabulary id)
    teacher_idx: torch.Tensor  # (N, k) head index of each teacher top-k token, -1 if not in the head
    teacher_p: torch.Tensor  # (N, k) teacher probabilities
    features: torch.Tensor | None = None  # (B, T, H) bfloat16: the target's state before each position


def make_batches(data: AnswerSet, head_tokens: torch.Tensor, vocab: int, batch_tokens: int,
                 states: list[torch.Tensor] | None = None) -> list[Batch]:
    """Training batches; with `states` (the target's states along each conversation, aligned
    with data) each batch carries the features a feature draft reads."""
    to_head = torch.full((vocab,), -1, dtype=torch.long)
    to_head[head_tokens] = torch.arange(len(head_tokens))
    seqs = [p + a for p, a in zip(data.prompt_ids, data.answer_ids)]
    return [_batch(data, group, ids, to_head, states) for group, ids in padded_groups(seqs, batch_tokens)]


def _batch(data: AnswerSet, group: list[int], input_ids: torch.Tensor, to_head: torch.Tensor,
           states: list[torch.Tensor] | None) -> Batch:
    rows, cols, answer, t_idx, t_p = [], [], [], [], []
    features = None
    if states is not None:  # position t reads the state at t - 1 (zeros at 0 and after the end)
        features = torch.zeros((*input_ids.shape, states[group[0]].shape[-1]), dtype=torch.bfloat16)
        for r, i in enumerate(group):
            features[r, 1:len(states[i])] = states[i][:-1]
    for r, i in enumerate(group):
        start, n = len(data.prompt_ids[i]) - 1, len(data.answer_ids[i])
        rows.append(torch.full((n,), r))
        cols.append(torch.arange(start, start + n))
        answer.append(torch.tensor(data.answer_ids[i]))
        t_idx.append(to_head[data.topk_ids[i].long()])
        t_p.append(data.topk_logp[i].float().exp())
    return Batch(input_ids, torch.cat(rows), torch.cat(cols), torch.cat(answer), torch.cat(t_idx), torch.cat(t_p),
                 features)


def answer_logits(draft: SpecUIDraftForCausalLM, batch: Batch, unknown: float | torch.Tensor = 0.0) -> torch.Tensor:
    """Head logits (N, K) at every answer position of the batch. A feature draft reads the
    batch's features, zeroed (as at the positions it proposes itself) at a random share
    `unknown` of positions, or where a (B, T) bool tensor `unknown` says."""
    ids = batch.input_ids.to(draft.device)
    if draft.feature_fc is None:
        hidden = draft.model(input_ids=ids, use_cache=False).last_hidden_state
    else:
        feats = batch.features.to(draft.device, torch.float32)
        if isinstance(unknown, torch.Tensor):
            feats = feats * ~unknown.to(draft.device)[..., None]
        elif unknown > 0:
            feats = feats * (torch.rand(feats.shape[:2], device=draft.device) >= unknown)[..., None]
        hidden = draft.model(inputs_embeds=draft.mix_features(ids, feats), use_cache=False).last_hidden_state
    return draft.head_logits(hidden[batch.rows, batch.cols])


def distill_loss(draft: SpecUIDraftForCausalLM, batch: Batch, unknown: float = 0.0) -> torch.Tensor:
    """Soft cross-entropy to the target's top-k distribution (tokens outside the head are
    unreachable for the draft and dropped): KL(p || q) up to the target's entropy."""
    logq = answer_logits(draft, batch, unknown).log_softmax(-1)
    idx = batch.teacher_idx.to(logq.device)
    p = batch.teacher_p.to(logq.device) * (idx >= 0)
    picked = logq.gather(-1, idx.clamp_min(0))
    return -(p * picked).sum(-1).mean()


@dataclass
class DraftQuality:
    positions: int
    agreement: float  # greedy top-1 agreement with the target along its answers
    alpha: float  # seeds' acceptance measure: E[sum_x min(p(x), q(x))] (p from the teacher's top-k)
    head_coverage: float  # fraction of answer tokens the head can propose
    expected_accepted: dict[int, float]  # greedy: mean tokens per target forward at gamma, teacher-forced
    # a feature draft: agreement where the state before its input is unknown (its own proposals)
    agreement_unknown_state: float | None = None


@torch.inference_mode()
def evaluate(draft: SpecUIDraftForCausalLM, data: AnswerSet, batch_tokens: int = 4096,
             gammas: tuple[int, ...] = (2, 3, 4, 5, 6), states: list[torch.Tensor] | None = None) -> DraftQuality:
    """Held-out quality along the target's answers. A feature draft (given the target's
    `states`) is measured twice: its first proposal of a step reads the target's state, the
    later ones do not (their input position was proposed by the draft); the replay uses the
    first for a step's first draft and the second for the rest (approximated by zeroing every
    other position's state)."""
    vocab = draft.config.vocab_size
    head = draft.token_map.cpu()
    in_head = torch.zeros(vocab, dtype=torch.bool)
    in_head[head] = True
    runs: list[tuple[list[bool], list[bool]]] = []
    n = agree = later_agree = covered = 0
    alpha = 0.0
    for batch in make_batches(data, head, vocab, batch_tokens, states):
        logq = answer_logits(draft, batch).float().log_softmax(-1).cpu()
        hit = head[logq.argmax(-1)] == batch.answer
        later = hit
        if draft.feature_fc is not None:
            later = torch.zeros_like(hit)
            parity = torch.arange(batch.input_ids.shape[1]) % 2
            for odd in (0, 1):
                unknown = (parity == odd).expand(batch.input_ids.shape)
                rows = unknown[batch.rows, batch.cols]
                later[rows] = (head[answer_logits(draft, batch, unknown).argmax(-1).cpu()] == batch.answer)[rows]
        agree += int(hit.sum())
        later_agree += int(later.sum())
        n += len(hit)
        covered += int(in_head[batch.answer].sum())
        q_at = torch.where(batch.teacher_idx >= 0, logq.gather(-1, batch.teacher_idx.clamp_min(0)).exp(), 0.0)
        alpha += float(torch.minimum(batch.teacher_p, q_at).sum())
        for r in range(int(batch.rows.max()) + 1):
            runs.append((hit[batch.rows == r].tolist(), later[batch.rows == r].tolist()))
    return DraftQuality(
        positions=n, agreement=agree / n, alpha=alpha / n, head_coverage=covered / n,
        expected_accepted={g: _mean_tokens_per_forward(runs, g) for g in gammas},
        agreement_unknown_state=later_agree / n if draft.feature_fc is not None else None,
    )


def _mean_tokens_per_forward(runs: list[tuple[list[bool], list[bool]]], gamma: int) -> float:
    """Replay greedy speculative decoding over teacher-forced agreement: each step accepts
    the drafts up to the first disagreement (at most gamma) and adds the target's token. A
    run is (hits of a step's first draft, hits of its later drafts) at each position."""
    tokens = forwards = 0
    for first, later in runs:
        t = 0
        while t < len(first):
            a = 0
            while a < gamma and t + a < len(first) and (first if a == 0 else later)[t + a]:
                a += 1
            t += a + 1
            tokens += a + 1
            forwards += 1
    return tokens / max(1, forwards)
