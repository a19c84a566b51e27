"""Gradio layout, handlers and plotly figure builders. Reads step traces only; no torch."""
