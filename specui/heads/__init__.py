"""The learned heads that steer drafting, each a small network trained by `python -m specui.train`.

acceptance.py: SpecDec++'s acceptance head (stop drafting when P(reject) crosses a threshold);
decision.py: MCSD's early-stop decision models; feature_draft.py: what turns a token draft
into one that reads the target's hidden states (EAGLE's idea).

They sit below the engine (torch only, no loading): the engine's methods read them from the
draft's session, and the service hands them over after loading."""
