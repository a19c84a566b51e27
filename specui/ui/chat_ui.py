"""The chat page: streaming chat, method switch, settings, live speculation panels.

The service is injected (specui.service.ChatService); this module reads only settings and
step traces (plain data)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gradio as gr

from specui.errors import SpecUIError
from specui.settings import ChatSettings
from specui.ui.figures import acceptance_figure, choices_figure, tree_figure

DESCRIPTIONS = {
    "autoregressive": "plain decoding: one target forward per token",
    "beam": "beam search (greedy) or beam sampling (temperature > 0) with W beams",
    "speculative": "draft gamma tokens, verify them in one target forward (lossless)",
    "tree": "a static draft tree (preset shape) verified in one target forward (lossless)",
    "opt-tree": "OPT-Tree: an adaptive draft tree maximising expected acceptance E(A) (lossless)",
}


def _text(content: Any) -> str:
    """Gradio may hand message content back as a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def _stats_line(stats: dict, notes: list[str] = ()) -> str:
    extra = "".join(f"\n\nℹ️ {n}" for n in dict.fromkeys(notes))
    return extra.lstrip() + "\n\n" + (
        f"**{stats['method']}** · {stats['new_tokens']} tokens · {stats['target_forwards']} target forwards · "
        f"mean accepted length {stats['mean_accepted_length']:.2f} · acceptance {stats['acceptance_rate']:.0%} · "
        f"{stats['tokens_per_s']:.1f} tok/s · {stats['finish_reason'] or 'running'}"
    )


def build_ui(service, title: str = "SpecUI") -> gr.Blocks:
    methods = service.methods
    tree_presets = service.tree_presets
    default = "speculative" if "speculative" in methods else methods[0]

    def user(message: str, history: list) -> tuple[str, list]:
        if not message or not message.strip():
            gr.Warning("The message is empty: type something to send.")
            return message, history
        return "", history + [{"role": "user", "content": message}]

    def bot(history: list, method, max_new, temperature, top_k, top_p, seed, gamma, width, preset, nodes,
            delta) -> Iterator:
        if not history or history[-1]["role"] != "user":
            return
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in history]
        settings = ChatSettings(
            method=method, max_new_tokens=int(max_new), temperature=float(temperature), top_k=int(top_k),
            top_p=float(top_p), seed=int(seed) if seed not in (None, "", -1) else None,
            gamma=int(gamma), width=int(width), preset=preset, nodes=int(nodes),
            delta=float(delta) if delta else None,
        )
        history = history + [{"role": "assistant", "content": ""}]
        try:
            generation, dropped = service.start(messages, settings)
            if dropped:
                gr.Info(f"Dropped the {dropped} oldest messages to fit the context window.")
            for step in service.stream(generation):
                history[-1]["content"] = step.text
                yield (history, tree_figure(step), acceptance_figure(generation.steps),
                       choices_figure(generation.steps), _stats_line(generation.stats.to_dict(), step.notes))
            last = generation.steps[-1] if generation.steps else None
            yield (history, tree_figure(last), acceptance_figure(generation.steps), choices_figure(generation.steps),
                   _stats_line(generation.stats.to_dict(), [n for s in generation.steps for n in s.notes]))
        except SpecUIError as e:
            history[-1]["content"] = f"⚠️ {e}"
            yield history, tree_figure(None), acceptance_figure([]), choices_figure([]), f"⚠️ {e}"

    with gr.Blocks(title=title) as demo:
        gr.Markdown(f"# {title}\nTarget: `{service.target_label}` · draft: `{service.draft_label}`")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(height=480, label="chat")
                box = gr.Textbox(placeholder="Message… (Enter to send)", show_label=False, elem_id="msg")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", elem_id="stop")
                    clear = gr.Button("Clear", elem_id="clear")
                stats = gr.Markdown(elem_id="stats")
            with gr.Column(scale=2):
                method = gr.Dropdown(methods, value=default, label="decoding method",
                                     info=DESCRIPTIONS.get(default, ""), elem_id="method")
                with gr.Accordion("settings", open=False):
                    max_new = gr.Slider(1, 2048, value=256, step=1, label="max new tokens")
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature", info="0 = greedy")
                    top_k = gr.Slider(0, 200, value=0, step=1, label="top-k", info="0 = off")
                    top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
                    seed = gr.Number(value=-1, precision=0, label="seed", info="-1 = random")
                    gamma = gr.Slider(1, 16, value=5, step=1, label="gamma (speculative draft length)")
                    width = gr.Slider(1, 8, value=4, step=1, label="beam width")
                    preset = gr.Dropdown(list(tree_presets), value="eagle-25", label="tree preset (tree)")
                    nodes = gr.Slider(1, 120, value=25, step=1, label="node budget n (opt-tree)")
                    delta = gr.Number(value=None, label="delta (opt-tree)", info="empty = measured mu")
                tree = gr.Plot(label="current step", elem_id="tree")
                accept = gr.Plot(label="accepted vs rejected", elem_id="accept")
                choices = gr.Plot(label="dynamic choices", elem_id="choices")

        method.change(lambda m: gr.update(info=DESCRIPTIONS.get(m, "")), method, method)
        inputs = [chatbot, method, max_new, temperature, top_k, top_p, seed, gamma, width, preset, nodes, delta]
        outputs = [chatbot, tree, accept, choices, stats]
        ev1 = box.submit(user, [box, chatbot], [box, chatbot], queue=False).then(bot, inputs, outputs)
        ev2 = send.click(user, [box, chatbot], [box, chatbot], queue=False).then(bot, inputs, outputs)
        stop.click(None, None, None, cancels=[ev1, ev2])
        clear.click(lambda: ([], tree_figure(None), acceptance_figure([]), choices_figure([]), ""), None, outputs,
                    queue=False)
    return demo
