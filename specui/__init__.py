"""SpecUI: a local chat app whose engine does speculative decoding and shows it."""

__version__ = "0.1.0"
