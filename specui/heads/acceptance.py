"""SpecDec++'s acceptance head (DESIGN.md 3.4): on the draft's last hidden state h_t (the
input of its output layer, after it has read candidate token t), predict
a_t = P(token t accepted | every candidate before it accepted).

A D-layer ResNet of SiLU blocks (D = 0: one linear layer) and a sigmoid. Every block has its
own weights (the seed's public code repeats one block object, so its layers share weights).

A head folder holds config.json (depth, hidden size, the draft it was trained for, the
tuned threshold, the held-out replay at each threshold) and head.safetensors; `load_head`
refuses a head made for another draft."""

from __future__ import annotations

import ast
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specui.errors import SpecUIError

TRAIN_COMMAND = "python -m specui.train head --draft DRAFT --out HEAD_FOLDER"
HEAD_MARKER = "specui_acceptance_head"


class ResidualSiLU(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


Q_STATS = 9  # entropy + top-8 probabilities of the q~ a candidate was drawn from


def q_stats(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) raw draft logits -> (..., Q_STATS): the entropy and the 8 largest
    probabilities of softmax(logits) (the same in training and at inference)."""
    native = native_softmax_stats(logits)
    if native is not None:
        return native[..., 1:].to(torch.float32)
    if logits.requires_grad and torch.is_grad_enabled():  # entr's gradient at p = 0 is infinite: log-probabilities
        logp = logits.float().log_softmax(-1)
        return prob_stats(logp.exp(), logp)
    return prob_stats(logits.float().softmax(-1))


def prob_stats(prob: torch.Tensor, logp: torch.Tensor | None = None) -> torch.Tensor:
    """q_stats of (..., V) probabilities already computed: the entropy (from their logarithms
    `logp` where given, else as entr: 0 log 0 = 0, so a reduced head's -inf columns add nothing,
    with no pass over exponentials of -inf or of underflowing log-probabilities, each a slow lane in
    torch's exp) and a top-8."""
    if logp is None:
        entropy = torch.special.entr(prob).sum(-1, keepdim=True)
    else:
        entropy = -(prob * logp.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
    return torch.cat([entropy, prob.topk(Q_STATS - 1, dim=-1).values], -1)


def native_softmax_stats(logits: torch.Tensor) -> torch.Tensor | None:
    """(..., V) logits on a CPU -> (..., 1 + Q_STATS) float64 [log-sum-exp, entropy, top-8
    probabilities] from SpecUI's kernel (specui/weights/kernels/entropy.cpp: one pass on every
    thread, each over the columns the draft head's same thread wrote) where this process has loaded
    it; None elsewhere (and where a gradient is wanted), and for rows with no finite softmax (NaN,
    +inf, all -inf), which torch's path answers as torch does."""
    if (logits.device.type != "cpu" or logits.shape[-1] < Q_STATS - 1 or logits.numel() == 0
            or (logits.requires_grad and torch.is_grad_enabled())):
        return None
    op = getattr(torch.ops.specui_native, "softmax_stats", None)
    if op is None:
        return None
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.float().contiguous()
    stats = op(rows, Q_STATS - 1)
    if stats.isnan().any():
        return None
    return stats.reshape(*logits.shape[:-1], 1 + Q_STATS)


class AcceptanceHead(torch.nn.Module):
    """With `use_q` the head also reads q_stats of the distribution the candidate was drawn
    from (embedded linearly and added to the hidden state): the hidden state after reading a
    token says little about how sure the draft was when it chose it.

    `reads`: "after" (the seed's) = the hidden state after the draft has read the candidate,
    which costs one more draft forward per chain (the forward that reads the last candidate);
    "before" = the hidden state that gave q~ for the candidate, with q_stats and q~(candidate)
    (use_q implied): the stop is decided before the candidate is fed, so a chain costs exactly
    one draft forward per candidate, as a fixed chain does."""

    def __init__(self, hidden_size: int, depth: int = 1, use_q: bool = False, reads: str = "after") -> None:
        super().__init__()
        if depth < 0:
            raise SpecUIError(f"acceptance head depth must be >= 0, got {depth}")
        if reads not in ("after", "before"):
            raise SpecUIError(f"an acceptance head reads the hidden state 'after' or 'before' the candidate, "
                              f"got {reads!r}")
        use_q = use_q or reads == "before"
        self.hidden_size, self.depth, self.use_q, self.reads = hidden_size, depth, use_q, reads
        self.q_embed = torch.nn.Linear(Q_STATS + (reads == "before"), hidden_size) if use_q else None
        self.blocks = torch.nn.ModuleList(ResidualSiLU(hidden_size) for _ in range(depth))  # one object each
        self.out = torch.nn.Linear(hidden_size, 1)

    def logit(self, hidden: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) [and (..., Q_STATS)] -> (...) logits of a_t."""
        x = hidden.to(self.out.weight.dtype)
        if self.q_embed is not None:
            x = x + self.q_embed(stats.to(x.dtype))
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def forward(self, hidden: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logit(hidden, stats))

    def predict(self, hidden: torch.Tensor, draft_logits: torch.Tensor, token: int) -> float:
        """a_t for one candidate `token`: the draft's hidden state (H,) (after reading it, or
        the one that gave its q~, as `reads` says), and the raw draft logits (V,) it was
        drawn from."""
        return float(self.predict_on_device(hidden, draft_logits, token))

    @torch.inference_mode()
    def predict_on_device(self, hidden: torch.Tensor, draft_logits: torch.Tensor, token) -> torch.Tensor:
        """`predict` as a 0-d tensor on the hidden state's device, unread; `token` an int or a
        0-d device tensor (a drafted argmax not read yet)."""
        stats = self._stats(draft_logits, token).unsqueeze(0) if self.use_q else None
        return self(hidden.unsqueeze(0), stats)[0]

    def _stats(self, draft_logits: torch.Tensor, token) -> torch.Tensor:
        """(Q_STATS,) q_stats of the raw draft logits (V,), and for a "before" head q~(token) after them."""
        native = native_softmax_stats(draft_logits)
        if native is not None:  # a CPU: one read of the kernel's row; q~(token) = exp(logit - lse)
            lse, *values = native.tolist()
            if self.reads == "before":
                values.append(math.exp(float(draft_logits[token]) - lse))
            return torch.tensor(values, dtype=torch.float32)
        prob = draft_logits.float().softmax(-1)
        stats = prob_stats(prob)
        return torch.cat([stats, prob[token].reshape(1)]) if self.reads == "before" else stats


def draft_fingerprint(draft: torch.nn.Module) -> str:
    """Who the draft is, independent of the dtype it runs in: its config, its source, and
    the checksum of its stored weights when it came from a folder."""
    cfg = draft.config
    source = str(getattr(cfg, "_name_or_path", "") or "")
    weights = Path(source) / "model.safetensors"
    parts = [json.dumps({k: v for k, v in sorted(cfg.to_dict().items())
                         if k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                                  "specui_draft", "model_type")}, sort_keys=True, default=str)]
    if weights.is_file():
        h = hashlib.sha1()
        with weights.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        parts.append(h.hexdigest())
    else:
        parts.append(Path(source).name)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def save_head(head: AcceptanceHead, folder: Path, draft_print: str, meta: dict) -> None:
    """Write config.json + head.safetensors (float32) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {HEAD_MARKER: 1, "hidden_size": head.hidden_size, "depth": head.depth, "use_q": head.use_q,
              "reads": head.reads,
              "draft_fingerprint": draft_print, **meta}
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    state = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / "head.safetensors"), metadata={"format": "pt"})


def read_marked_config(folder: str | Path, marker: str, what: str, command: str) -> dict:
    """config.json of a learned helper's folder (an acceptance head, MCSD's decision models),
    checked for its marker; raises SpecUIError naming `what` and the training `command`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise SpecUIError(f"no {what} at {folder} (no config.json); train one with: {command}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SpecUIError(f"the {what} config {path} is unreadable ({e}); retrain it with: {command}") from None
    if not isinstance(config, dict) or marker not in config:
        raise SpecUIError(f"{folder} is not a folder of {what}; train one with: {command}")
    return config


def read_head_config(folder: str | Path) -> dict:
    return read_marked_config(folder, HEAD_MARKER, "acceptance head", TRAIN_COMMAND)


def threshold_replay(points) -> list[dict]:
    """The SpecDec++ rows of a head's held-out greedy replay (`heldout_replay` in its metrics: a
    list, or its Python repr as older heads wrote it) as {threshold, discard_rate,
    verification_rate}: what choosing the threshold for a machine's costs reads. [] if unreadable."""
    try:
        rows = ast.literal_eval(points) if isinstance(points, str) else points
        return [{"threshold": float(str(p["setting"]).removeprefix("H ")), "discard_rate": float(p["discard_rate"]),
                 "verification_rate": float(p["verification_rate"])}
                for p in rows if p.get("method") == "specdec++" and str(p.get("setting", "")).startswith("H ")]
    except (ValueError, SyntaxError, TypeError, KeyError, AttributeError):
        return []


def _replay_of(folder: Path, config: dict) -> list[dict]:
    """The config's threshold replay, else the one in the folder's metrics.json (heads saved
    before configs carried it); [] where neither has one."""
    if isinstance(config.get("threshold_replay"), list):
        return config["threshold_replay"]
    try:
        metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
        return threshold_replay(metrics.get("heldout_replay", []))
    except (OSError, ValueError, AttributeError):
        return []


def load_head(folder: str | Path, draft: torch.nn.Module) -> tuple[AcceptanceHead, dict]:
    """The head in `folder` for this draft, on the draft's device (float32), and its config.
    Raises SpecUIError naming the training command when it is missing, corrupt or made
    for another draft."""
    folder = Path(folder)
    config = read_head_config(folder)
    made_for, this = config.get("draft_fingerprint"), draft_fingerprint(draft)
    if made_for != this:
        raise SpecUIError(f"the acceptance head in {folder} was trained for another draft (fingerprint "
                          f"{made_for}, this draft {this}); retrain it with: {TRAIN_COMMAND}")
    hidden = int(draft.config.hidden_size)
    if config.get("hidden_size") != hidden:
        raise SpecUIError(f"the acceptance head in {folder} takes hidden size {config.get('hidden_size')}, "
                          f"the draft has {hidden}; retrain it with: {TRAIN_COMMAND}")
    try:
        head = AcceptanceHead(hidden, int(config["depth"]), bool(config.get("use_q", False)),
                              str(config.get("reads", "after")))
        head.load_state_dict(load_file(str(folder / "head.safetensors")))
    except Exception as e:  # noqa: BLE001 - any failure to read the weights (safetensors' own errors too)
        raise SpecUIError(f"the acceptance head in {folder} is corrupt ({type(e).__name__}: {str(e)[:200]}); "
                          f"retrain it with: {TRAIN_COMMAND}") from None
    device = next(draft.parameters()).device
    config = {**config, "threshold_replay": _replay_of(folder, config)}
    return head.to(device=device, dtype=torch.float32).eval(), config
