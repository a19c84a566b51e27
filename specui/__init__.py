"""SpecUI: a local chat app whose engine does speculative decoding and shows it.

Floors, lowest first; a module imports only from its own floor or below (tests/test_layout.py):
errors.py and settings.py (one validation layer); heads/ (learned heads that steer drafting);
engine/ (one generate loop, sessions, the methods); weights/ (model preparation: loading,
quantization, measured choices, the draft model); chat.py (chat templates); service/ (the
pair, the chat service, continuous batching); ui/ and cli.py; webapp.py; bench/; train/."""

__version__ = "0.1.0"
