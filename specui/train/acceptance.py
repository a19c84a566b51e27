"""Training data, training and evaluation of SpecDec++'s acceptance head (DESIGN.md 3.4).

Data, per conversation the target answered (prompt P, answer X of T tokens):
  1. the draft reads P + X: q(. | X_<t) at every answer position, and y_t ~ q is drawn;
  2. token mixing: z_t = X_t with probability r, else y_t (a draft token);
  3. the draft reads P + Z: its hidden state after reading z_t (the head's input) and
     q(z_t | Z_<t); the target reads P + Z: p(z_t | Z_<t);
  4. at draft positions only: the soft label min(1, p(z_t) / q(z_t)) (the probability that
     z_t, drafted in this context, is accepted at temperature 1) and the greedy label
     [argmax p(. | Z_<t) = z_t]; the entropy and top probabilities of q are kept too (MCSD's
     decision models read them).

Evaluation: held-out BCE and binary KL, a calibration table, and an exact replay of greedy
speculative decoding along the target's own greedy answers (greedy SpecDec++ commits exactly
those tokens), which gives N, D and V for any threshold without decoding: accepted tokens and
target calls are exact; tokens drafted after the first wrong one are estimated by repeating
that token's a_t (their hidden states would need the draft run past a wrong token)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specui.engine.hidden import output_layer_inputs
from specui.engine.masks import additive, mask_dtype
from specui.heads.acceptance import AcceptanceHead, draft_fingerprint, q_stats
from specui.train.data import AnswerSet, SavedFields
from specui.train.trainer import TrainConfig, train

TOPK_STATS = 8  # top probabilities of q kept per example (heads.Q_STATS - 1)


@torch.inference_mode()
def forward_hidden(model, ids: list[int], keep: int, attention_mask=None, position_ids=None):
    """Logits (keep, V) and the output layer's input (keep, H) at the last `keep` positions."""
    with output_layer_inputs(model) as seen:
        out = model(input_ids=torch.tensor([ids], device=model.device), attention_mask=attention_mask,
                    position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    return out.logits[0, -keep:].float(), seen[-1][0, -keep:].float()


@dataclass
class Features(SavedFields):
    """One example per draft position: head input, labels, q's entropy and top probabilities."""

    hidden: torch.Tensor  # (n, H) float16, after the draft read the token
    hidden_before: torch.Tensor  # (n, H) float16, the hidden state that gave q~ for the token
    q_token: torch.Tensor  # (n,) q~ of the token itself
    soft: torch.Tensor  # (n,) min(1, p/q)
    greedy: torch.Tensor  # (n,) 1 if the target's argmax is the token
    entropy: torch.Tensor  # (n,)
    q_top: torch.Tensor  # (n, TOPK_STATS)
    done: list[str] = field(default_factory=list)  # conversation ids already in (resuming)

    def __len__(self) -> int:
        return int(self.soft.shape[0])

    @classmethod
    def empty(cls, hidden_size: int) -> Features:
        empty = torch.zeros(0, hidden_size, dtype=torch.float16)
        return cls(empty, empty.clone(), torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0),
                   torch.zeros(0, TOPK_STATS))

    def append(self, other: Features) -> None:
        for name in ("hidden", "hidden_before", "q_token", "soft", "greedy", "entropy", "q_top"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.done.extend(other.done)

    @property
    def stats(self) -> torch.Tensor:
        """(n, Q_STATS): heads.q_stats of the q each token was drawn from."""
        return torch.cat([self.entropy[:, None], self.q_top], -1)

    def inputs(self, reads: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A head's (hidden, stats) inputs: see heads.AcceptanceHead `reads`."""
        if reads == "before":
            return self.hidden_before, torch.cat([self.stats, self.q_token[:, None]], -1)
        return self.hidden, self.stats

    def labels(self, kind: str) -> torch.Tensor:
        return self.soft if kind == "soft" else self.greedy


def sequence_features(draft, target, prompt: list[int], answer: list[int], mix: float,
                      generator: torch.Generator) -> Features:
    """The examples of one conversation (steps 1-4 of the module docstring)."""
    n = len(answer)
    q_logits, _ = forward_hidden(draft, prompt + answer, n + 1)
    y = torch.multinomial(q_logits[:n].softmax(-1), 1, generator=generator).squeeze(-1)
    from_target = torch.rand(n, generator=generator) < mix
    z = torch.where(from_target, torch.tensor(answer), y).tolist()
    q2_logits, hidden = forward_hidden(draft, prompt + z, n + 1)
    p_logits, _ = forward_hidden(target, prompt + z, n + 1)
    rows = torch.arange(n)
    zt = torch.tensor(z)
    q = q2_logits[:n].softmax(-1)[rows, zt]
    p = p_logits[:n, : q2_logits.shape[-1]].softmax(-1)[rows, zt]
    soft = torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q))
    greedy = (p_logits[:n].argmax(-1) == zt).float()
    stats = q_stats(q2_logits[:n])
    entropy, q_top = stats[:, 0], stats[:, 1:]
    at = ~from_target
    return Features(hidden[1:][at].half(), hidden[:-1][at].half(), q[at], soft[at], greedy[at], entropy[at],
                    q_top[at])


def draft_cache(work: Path, stem: str, draft) -> Path:
    """Where examples drawn with `draft` are cached: the name carries its fingerprint (its
    stored weights' checksum), so another draft, even a retrain written to the same folder,
    never reads them."""
    return Path(work) / f"{stem}-{draft_fingerprint(draft)[:10]}.pt"


def build_features(draft, target, answers: AnswerSet, mix: float, seed: int, path: Path | None = None,
                   save_every: int = 64) -> Features:
    """Examples of every conversation in `answers`, saved every `save_every` conversations
    to `path` (a rerun resumes; conversations already in are skipped)."""
    feats = Features.load(path) if path is not None and path.is_file() else Features.empty(draft.config.hidden_size)
    done = set(feats.done)
    todo = [i for i, cid in enumerate(answers.ids) if cid not in done]
    bar = tqdm(total=len(answers), initial=len(done), desc=f"head data r={mix}", unit="answer")
    for count, i in enumerate(todo, 1):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)  # per conversation: resuming draws the same
        one = sequence_features(draft, target, answers.prompt_ids[i], answers.answer_ids[i], mix, g)
        one.done = [answers.ids[i]]
        feats.append(one)
        bar.update(1)
        if path is not None and (count % save_every == 0 or count == len(todo)):
            feats.save(path)
    bar.close()
    return feats


# --- training -------------------------------------------------------------------------------------
def head_loss(head: AcceptanceHead, hidden: torch.Tensor, stats: torch.Tensor, label: torch.Tensor,
              w_rej: float) -> torch.Tensor:
    """Weighted BCE with soft labels: w_acc = 1 on the accepted part, w_rej on the rejected part."""
    logit = head.logit(hidden.float(), stats)
    logsig = torch.nn.functional.logsigmoid
    return -(label * logsig(logit) + w_rej * (1.0 - label) * logsig(-logit)).mean()


def batches(feats: Features, labels: str, reads: str, size: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(seed))
    y = feats.labels(labels)
    hidden, stats = feats.inputs(reads)
    return [(hidden[idx], stats[idx], y[idx]) for idx in order.split(size)]


def train_head(feats: Features, depth: int, w_rej: float, labels: str = "soft", use_q: bool = False,
               reads: str = "after", epochs: int = 3, lr: float = 1e-3, batch_size: int = 512, seed: int = 0,
               checkpoint: Path | None = None) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(feats.hidden.shape[1], depth, use_q, reads)
    data = batches(feats, labels, reads, batch_size, seed)
    cfg = TrainConfig(epochs=epochs, lr=lr, seed=seed, warmup_steps=min(20, len(data)), checkpoint=checkpoint)
    train(head, data, lambda b: head_loss(head, b[0], b[1], b[2], w_rej), cfg,
          desc=f"head D={depth} w_rej={w_rej} {labels}{' +q' if use_q else ''} {reads}")
    return head.eval()


@dataclass
class HeadQuality:
    bce: float  # unweighted BCE against the labels
    kl: float  # BCE minus the labels' own entropy (0 = perfect)
    calibration: list[tuple[float, float, int]]  # (mean predicted, mean label, count) per bin of predictions


@torch.no_grad()
def head_quality(head: AcceptanceHead, feats: Features, labels: str = "soft", bins: int = 10) -> HeadQuality:
    hidden, stats = feats.inputs(head.reads)
    return prediction_quality(head(hidden.float(), stats), feats.labels(labels), bins)


def prediction_quality(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> HeadQuality:
    """BCE, KL and calibration of predicted acceptances against (soft) labels; shared by the
    acceptance head and MCSD's decision models."""
    y = label.double()
    a = pred.double().clamp(1e-7, 1 - 1e-7)
    bce = -(y * a.log() + (1 - y) * (1 - a).log()).mean()
    yc = y.clamp(1e-7, 1 - 1e-7)
    entropy = -(yc * yc.log() + (1 - yc) * (1 - yc).log()).mean()
    which = (a * bins).long().clamp(max=bins - 1)
    table = [(float(a[which == b].mean()), float(y[which == b].mean()), int((which == b).sum()))
             for b in range(bins) if (which == b).any()]
    return HeadQuality(float(bce), float(bce - entropy), table)


# --- exact greedy replay -------------------------------------------------------------------------
@dataclass
class GreedyAnswer:
    """Along one greedy answer: does the draft's greedy token match (match[t]); the head's
    input after reading the true token (hidden_true[t]) and, where it does not match, after
    reading the draft's own token at that position (hidden_wrong[t])."""

    match: list[bool]
    hidden_true: torch.Tensor  # (T, H)
    hidden_wrong: dict[int, torch.Tensor]
    stats: torch.Tensor  # (T, Q_STATS): q_stats of the draft's q at each position (true and wrong alike)
    hidden_before: torch.Tensor  # (T, H): the hidden state that gave q at each position


@torch.inference_mode()
def greedy_answer(draft, prompt: list[int], answer: list[int]) -> GreedyAnswer:
    n, base = len(answer), len(prompt)
    logits, hidden = forward_hidden(draft, prompt + answer, n + 1)
    guess = logits[:n].argmax(-1).tolist()
    match = [g == x for g, x in zip(guess, answer)]
    wrong = [t for t in range(n) if not match[t]]
    hidden_wrong = {}
    if wrong:  # each wrong token sits at its answer position, reading only the true prefix before it
        total = base + n + len(wrong)
        attend = torch.zeros(total, total, dtype=torch.bool)
        attend[: base + n, : base + n] = torch.ones(base + n, base + n, dtype=torch.bool).tril()
        for j, t in enumerate(wrong):
            attend[base + n + j, : base + t] = True
            attend[base + n + j, base + n + j] = True
        mask = additive(attend, mask_dtype(draft))
        positions = list(range(base + n)) + [base + t for t in wrong]
        _, side = forward_hidden(draft, prompt + answer + [guess[t] for t in wrong], len(wrong),
                                 attention_mask=mask[None, None].to(draft.device),
                                 position_ids=torch.tensor([positions], device=draft.device))
        hidden_wrong = dict(zip(wrong, side))
    return GreedyAnswer(match, hidden[1:], hidden_wrong, q_stats(logits[:n]), hidden[:-1])


@dataclass
class Replay:
    """Counts of a replayed greedy decoding: N generated tokens, D discarded drafts, V target
    calls, draft forwards, and the target call sizes (draft tokens + 1 each)."""

    generated: int = 0
    discarded: int = 0
    verified: int = 0
    draft_forwards: int = 0
    call_sizes: list[int] = field(default_factory=list)

    def add(self, other: Replay) -> None:
        self.generated += other.generated
        self.discarded += other.discarded
        self.verified += other.verified
        self.draft_forwards += other.draft_forwards
        self.call_sizes += other.call_sizes

    @property
    def discard_rate(self) -> float:
        return self.discarded / max(1, self.generated)

    @property
    def verification_rate(self) -> float:
        return self.verified / max(1, self.generated)

    def time_ms(self, draft_ms: float, target_ms) -> float:
        """T = t_draft x draft forwards + sum of the target's cost for each call's size."""
        return draft_ms * self.draft_forwards + sum(target_ms(k) for k in self.call_sizes)


def replay(match: list[bool], accept: list[float] | None, wrong_accept: dict[int, float] | None,
           threshold: float, gamma_max: int, extra_forward: bool = True) -> Replay:
    """Greedy decoding of one answer (its last token is the end) with a fixed chain of
    gamma_max (accept None) or SpecDec++'s stop rule (accept[t]: a_t of the true token t;
    wrong_accept[t]: a_t of the draft's wrong token at t). `extra_forward`: the head reads
    the hidden state after each candidate (the seed's), which costs a draft forward more."""
    n, s, out = len(match), 0, Replay()
    while s < n:
        drafted, accepted, keep, evaluated, wrong = 0, 0, 1.0, 0, False
        while drafted < gamma_max and s + drafted < n:
            t = s + drafted
            drafted += 1
            if not match[t]:
                wrong = True
                if accept is None:  # a fixed chain is drafted to its end whatever it holds
                    drafted = gamma_max
                else:  # drafts after the wrong one: estimated with its a_t
                    a = wrong_accept[t]
                    while drafted < gamma_max:
                        keep *= a
                        evaluated += 1
                        if 1.0 - keep > threshold:
                            break
                        drafted += 1
                break
            accepted += 1
            if t == n - 1 or drafted >= gamma_max:  # the end token, or the cap: no a_t needed
                break
            if accept is not None:
                keep *= accept[t]
                evaluated += 1
                if 1.0 - keep > threshold:
                    break
        new = accepted + 1 if (wrong or s + accepted < n) else accepted
        out.generated += new
        out.discarded += drafted - accepted
        out.verified += 1
        out.draft_forwards += (1 + evaluated if drafted else 0) if accept is not None and extra_forward else drafted
        out.call_sizes.append(drafted + 1)
        s += new
    return out


@torch.no_grad()
def head_values(head: AcceptanceHead, answers: Iterable[GreedyAnswer]) -> list[tuple[list[float], dict[int, float]]]:
    values = []
    for ans in answers:
        if head.reads == "before":  # the draft's greedy guess at t, right or wrong: the same inputs
            stats = torch.cat([ans.stats, ans.stats[:, 1:2]], -1)  # q~(guess) = the top probability
            true = head(ans.hidden_before.float(), stats).tolist()
            values.append((true, {t: true[t] for t in range(len(true)) if not ans.match[t]}))
            continue
        true = head(ans.hidden_true.float(), ans.stats).tolist()
        wrong = {}
        if ans.hidden_wrong:
            keys = list(ans.hidden_wrong)
            hidden = torch.stack([ans.hidden_wrong[k] for k in keys]).float()
            wrong = dict(zip(keys, head(hidden, ans.stats[keys]).tolist()))
        values.append((true, wrong))
    return values


def replay_all(answers: list[GreedyAnswer], values, threshold: float, gamma_max: int,
               extra_forward: bool = True) -> Replay:
    total = Replay()
    for i, ans in enumerate(answers):
        accept, wrong = values[i] if values is not None else (None, None)
        total.add(replay(ans.match, accept, wrong, threshold, gamma_max, extra_forward))
    return total


def tokens_per_s(r: Replay, draft_ms: float, target_ms) -> float:
    ms = r.time_ms(draft_ms, target_ms)
    return 1000.0 * r.generated / ms if ms > 0 else math.inf
