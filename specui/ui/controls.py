"""The settings controls of the page: which ChatSettings fields they edit (in the order the
handlers receive them), their ranges and tooltips, and each method's one-line description."""

from __future__ import annotations

import gradio as gr

from specui.settings import ChatSettings

DESCRIPTIONS = {
    "auto": "chooses autoregressive or speculative (and gamma) each step from the measured cost profile "
            "and the running acceptance, and tries OPT-Tree (up to the node budget) where the profile says a "
            "tree could pay, keeping it while measured faster; never slower than plain decoding by design "
            "(lossless)",
    "autoregressive": "plain decoding: one target forward per token",
    "beam": "beam search (greedy) or beam sampling (temperature > 0) with W beams",
    "dsbd": "DSBD: the draft beam-samples a forest (W_S per layer, up to gamma layers, as deep as measured to "
            "pay; 0 = a plain beam step) from W_L beams, the target verifies it layer by layer in one forward; "
            "greedy = exact beam search, sampling = exact beam sampling",
    "specdec++": "SpecDec++: drafts while the trained acceptance head's predicted P(some candidate is rejected) "
                 "stays under the threshold, then verifies as speculative (lossless)",
    "speculative": "draft gamma tokens, verify them in one target forward (lossless)",
    "tree": "a static draft tree (preset shape) verified in one target forward (lossless)",
    "mcsd": "MCSD: forks of W draft chains (up to gamma deep) under the target's own last token, verified in "
            "one forward with multi-candidate rejection sampling (lossless); a decision model stops drafting "
            "early; a k-config (e.g. 4,2,2,1,1) gives the baseline tree. Root selection 'approximate' is the "
            "seed's and is NOT lossless",
    "opt-tree": "OPT-Tree: an adaptive draft tree maximising expected acceptance E(A) (lossless)",
    "lookup": "prompt lookup: drafts by copying what followed the last few tokens earlier in the conversation "
              "(no draft model), verified as speculative (lossless); pays on summaries, rewrites and code edits",
    "ems-sd": "EMS-SD: chats from every tab (and alternative replies) decode together in one batch, each row "
              "accepting its own number of draft tokens, with no padding in the KV cache or the inputs (lossless); "
              "the draft length is chosen per step from the measured costs (0 where batched plain decoding is faster)",
}
METHOD_EXTRA_FIELDS = {"ems-sd": {"replies"}}  # settings a method reads beside its constructor's

# The ChatSettings fields behind the settings controls, in the order the handlers receive them.
SETTING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "width", "preset",
                  "nodes", "delta", "system", "draft_width", "width_threshold", "min_width", "memory_mode",
                  "threshold", "gamma_max", "k_config", "root_selection", "decision", "stop_threshold",
                  "lookup_tokens", "padding", "adaptive_gamma", "adaptive_nodes", "replies")
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "system"}  # shown for every method


def settings_controls(defaults: ChatSettings, tree_presets: list[str], max_new_tokens: int = 2048,
                      max_replies: int = 8) -> dict[str, gr.components.Component]:
    """The controls, starting from `defaults`; the sliders of reply length and alternative
    replies end at `max_new_tokens` and `max_replies` (a shared app's visitor limits)."""
    controls = {
        "max_new_tokens": gr.Slider(1, max_new_tokens, value=defaults.max_new_tokens, step=1, label="max new tokens",
                                    info="longest reply; the context window caps it too"),
        "temperature": gr.Slider(0, 2, value=defaults.temperature, step=0.05, label="temperature",
                                 info="0 = greedy (lossless methods then reproduce plain greedy decoding)"),
        "top_k": gr.Slider(0, 200, value=defaults.top_k, step=1, label="top-k",
                           info="sample only from the k most likely tokens; 0 = off"),
        "top_p": gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="top-p",
                           info="nucleus sampling: the smallest set holding this much probability"),
        "seed": gr.Number(value=-1 if defaults.seed is None else defaults.seed, precision=0, label="seed",
                          info="same seed + settings = same reply, except where a method chooses by measured "
                               "speed (auto, adaptive ems-sd / dsbd: its draws follow its choices); -1 = random"),
        "gamma": gr.Slider(1, 16, value=defaults.gamma, step=1, label="gamma",
                           info="speculative: draft tokens proposed per step (higher pays when the draft agrees)"),
        "width": gr.Slider(1, 16, value=defaults.width, step=1, label="width W",
                           info="beam: number of beams kept per step; dsbd: W_L, the most beams kept; "
                                "mcsd: chains per fork"),
        "draft_width": gr.Number(value=defaults.draft_width, precision=0, label="draft width W_S",
                                 info="dsbd: beams the draft samples per layer of the forest; empty = 2 W_L"),
        "width_threshold": gr.Number(value=defaults.width_threshold, label="width threshold t",
                                     info="dsbd: dynamic width, keeping K beams while P(at least K of the draft's "
                                          "candidates are accepted) >= t; empty = fixed width W_L"),
        "min_width": gr.Slider(1, 8, value=defaults.min_width, step=1, label="min width W_min",
                               info="dsbd: dynamic width never keeps fewer beams"),
        "memory_mode": gr.Checkbox(value=defaults.memory_mode, label="memory mode",
                                   info="dsbd: continue from the best output beam only (one KV cache)"),
        "threshold": gr.Number(value=defaults.threshold, label="stop threshold H",
                               info="specdec++: stop drafting once the head's P(at least one candidate is rejected) "
                                    "exceeds H (higher: longer chains); empty = chosen for this pair's measured costs"),
        "gamma_max": gr.Slider(1, 32, value=defaults.gamma_max, step=1, label="gamma max",
                               info="specdec++: the most candidates per step"),
        "k_config": gr.Textbox(value=defaults.k_config, label="k-config",
                               info="mcsd baseline: candidates sampled under each node at depth 1, 2, ... (e.g. "
                                    "4,2,2,1,1); empty = forks of W chains (width) of up to gamma tokens"),
        "root_selection": gr.Radio(["lossless", "approximate"], value=defaults.root_selection,
                                   label="root selection",
                                   info="mcsd forks: 'approximate' (the seed's) draws W roots from the target and "
                                        "keeps the one accepted longest: approximate, NOT lossless (sampling only)"),
        "decision": gr.Radio(["hidden", "entropy", "none"], value=defaults.decision, label="early-stop decision model",
                             info="mcsd forks: hidden = 3-layer MLP on the draft's hidden state; entropy = 2-layer "
                                  "MLP on q's entropy and top probabilities; none = always draft gamma"),
        "stop_threshold": gr.Slider(0.05, 0.95, value=defaults.stop_threshold, step=0.05,
                                    label="mcsd stop threshold",
                                    info="mcsd forks: stop drafting when every chain's predicted acceptance is below"),
        "lookup_tokens": gr.Slider(1, 32, value=defaults.lookup_tokens, step=1, label="lookup tokens",
                                   info="lookup (and auto's lookup steps): most tokens proposed a step"),
        "padding": gr.Radio(["unpad", "unpad-kv", "vanilla"], value=defaults.padding, label="batch padding",
                            info="ems-sd: unpad = EMS-SD (no padding in the cache or the inputs); unpad-kv = padded "
                                 "inputs; vanilla = padded cache and inputs (the comparison)"),
        "adaptive_gamma": gr.Checkbox(value=defaults.adaptive_gamma, label="adaptive draft length",
                                      info="ems-sd: choose the batch's draft length (0..gamma) per step from the "
                                           "measured costs; dsbd: the forest's depth (0..gamma, 0 = a beam "
                                           "sampling step) from its own timed steps; off = always gamma"),
        "replies": gr.Slider(1, max_replies, value=defaults.replies, step=1, label="alternative replies",
                             info="ems-sd: answer with n replies decoded together (they differ when temperature "
                                  "> 0); the last is the one the chat continues from"),
        "preset": gr.Dropdown(tree_presets, value=defaults.preset, label="tree preset",
                              info="tree: the static draft tree's shape (nodes per depth)"),
        "nodes": gr.Slider(1, 120, value=defaults.nodes, step=1, label="node budget n",
                           info="opt-tree (and auto's trees): most draft tokens verified per step"),
        "adaptive_nodes": gr.Checkbox(value=defaults.adaptive_nodes, label="adaptive node budget",
                                      info="opt-tree: choose the budget (1..n) per step from the measured costs "
                                           "and the tree just drafted; off = always n"),
        "delta": gr.Number(value=defaults.delta, label="delta",
                           info="opt-tree: stop growing when E(A) gains less; empty = measured draft/target cost"),
        "system": gr.Textbox(value=defaults.system, label="system prompt", lines=2,
                             info="instructions for the whole chat; empty = the model's default. Sent as text: "
                                  "special tokens typed here stay text"),
    }
    for name, control in controls.items():
        control.elem_id = f"set-{name}"
    return controls
