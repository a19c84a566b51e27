"""Training: draft distillation (and the shared plumbing the SpecDec++ acceptance head and
the MCSD decision models reuse: data collection along target answers, a tiny trainer,
save / load under models/)."""
