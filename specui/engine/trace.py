"""Step traces: plain Python data, one per target forward pass. The UI reads only these."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# Node statuses (DESIGN.md 4). "target" = a token the target produced with no draft;
# DSBD adds "dropped" (its parent beam was rejected) and "filled" (a beam drawn from the
# target's p_beam to fill the width after too few were accepted).
ACCEPTED, REJECTED, RESAMPLED, BONUS, UNVERIFIED, TARGET, DROPPED, FILLED = (
    "accepted", "rejected", "resampled", "bonus", "unverified", "target", "dropped", "filled",
)
STATUSES = (ACCEPTED, REJECTED, RESAMPLED, BONUS, UNVERIFIED, TARGET, DROPPED, FILLED)


@dataclass
class NodeTrace:
    """One token of a step's tree (or chain, or beam layer). parent = -1 for roots."""

    token_id: int
    text: str
    parent: int
    depth: int
    status: str
    q: float | None = None  # draft probability of this token (warped)
    p: float | None = None  # target probability of this token (warped)
    p_hat: float | None = None  # product of draft probabilities along the path (trees)
    beam: int | None = None  # which beam / tree of a forest this node belongs to
    score: float | None = None  # beam log-likelihood after this token (under the target)
    draft_score: float | None = None  # the same joint log-probability under the draft (DSBD's forest)
    accept_pred: float | None = None  # SpecDec++: the head's a_t = P(accepted | all before accepted); MCSD: the
    # decision model's predicted acceptance of this candidate
    reject_pred: float | None = None  # SpecDec++: 1 - prod a_i up to this candidate (the stop rule's input)

    @property
    def accept_ratio(self) -> float | None:
        if self.p is None or not self.q:
            return None
        return min(1.0, self.p / self.q)


@dataclass
class StepTrace:
    """What one engine step did: the drafted nodes and their fate, what was committed,
    the dynamic choices made, and timings."""

    index: int
    method: str
    nodes: list[NodeTrace] = field(default_factory=list)
    drafted: int = 0  # draft tokens proposed this step
    accepted: int = 0  # draft tokens accepted this step
    new_token_ids: list[int] = field(default_factory=list)
    new_from_draft: list[bool] = field(default_factory=list)  # provenance of each new token
    new_text: str = ""
    replaces: bool = False  # new_token_ids replace the reply so far (beam search's best beam)
    new_draft_chars: int = 0  # how many leading characters of new_text came from accepted drafts
    text: str = ""  # the reply so far (beam search may rewrite it)
    gamma: int | None = None  # candidate length used this step
    beam_width: int | None = None
    tree_nodes: int | None = None  # draft tree size verified this step
    tree_depth: int | None = None
    expected_accept: float | None = None  # OPT-Tree's E(A) for this step's tree
    notes: list[str] = field(default_factory=list)  # clamps and calibrations worth showing
    choice: str | None = None  # what `auto` chose this step ("autoregressive", "speculative:2")
    layer_widths: list[int] | None = None  # DSBD: the beam width chosen at each verified layer
    stop_layer: int | None = None  # DSBD: the layer where verification stopped (gamma + 1: all passed)
    beams: list[dict] | None = None  # beam methods: the beams after the step, [{"text", "score"}]
    threshold: float | None = None  # SpecDec++: the stop threshold H on the rejection risk
    stop_reason: str | None = None  # SpecDec++ / MCSD: why drafting stopped (threshold, gamma_max, eos, decision, ...)
    stop_value: float | None = None  # SpecDec++: P(some rejected) at the stop; MCSD: best chain's predicted acceptance
    chains: int | None = None  # MCSD forks: chains drafted this step
    batch_size: int | None = None  # EMS-SD: sequences decoded together in this step
    batch_accepted: list[int] | None = None  # EMS-SD: draft tokens each row of the batch accepted this step
    batch_row: int | None = None  # EMS-SD: this generation's row in batch_accepted
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    step_ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepTrace:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["nodes"] = [NodeTrace(**n) for n in d.get("nodes", [])]
        return cls(**kw)


@dataclass
class GenerationStats:
    """Per-generation figures (the CLI prints these)."""

    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    max_draft_len: int = 0  # sum over steps of the longest draft a step could have had accepted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    mean_batch_size: float = 0.0  # ems-sd: sequences decoded together per step, averaged over this one's steps
    # of decode_s, the seconds inside the models' forward calls (CPU; None where not measured: a GPU, EMS-SD)
    forward_s: float | None = None

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / steps: tokens committed per target forward for chain methods."""
        return 1.0 + self.accepted / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """MCSD's (seed 001) acceptance rate: accepted draft length / maximum draft length
        (a chain's length, a tree's depth), over all steps. For chains: accepted / drafted."""
        return self.accepted / self.max_draft_len if self.max_draft_len else 0.0

    @property
    def token_acceptance(self) -> float:
        """Accepted / drafted tokens (a tree's unused branches count as drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def discard_rate(self) -> float:
        """SpecDec++'s D/N: drafted tokens thrown away per generated token."""
        return (self.drafted - self.accepted) / self.new_tokens if self.new_tokens else 0.0

    @property
    def verification_rate(self) -> float:
        """SpecDec++'s V/N: target forwards per generated token."""
        return self.target_forwards / self.new_tokens if self.new_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def outside_share(self) -> float | None:
        """The share of the decode's time spent outside the models' forwards (our Python:
        masks, sampling, acceptance, bookkeeping, detokenizing), or None where not measured."""
        return outside_share(self.forward_s, self.decode_s)

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_length=round(self.mean_accepted_length, 4),
            acceptance_rate=round(self.acceptance_rate, 4),
            token_acceptance=round(self.token_acceptance, 4),
            discard_rate=round(self.discard_rate, 4),
            verification_rate=round(self.verification_rate, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
            wall_s=round(self.wall_s, 4),
            outside_share=None if self.outside_share is None else round(self.outside_share, 4),
        )
        return d


def outside_share(forward_s: float | None, decode_s: float) -> float | None:
    """The share of `decode_s` not spent in forwards that took `forward_s` (None: not measured)."""
    if forward_s is None or decode_s <= 0:
        return None
    return max(0.0, 1.0 - forward_s / decode_s)


def traces_to_json(steps: list[StepTrace], stats: GenerationStats | None = None) -> str:
    return json.dumps(
        {"stats": stats.to_dict() if stats else None, "steps": [s.to_dict() for s in steps]},
        ensure_ascii=False,
    )


def traces_from_json(text: str) -> list[StepTrace]:
    return [StepTrace.from_dict(s) for s in json.loads(text)["steps"]]
