"""torch.compile of one loaded model, with guards that cost little to check on every forward.

Before each call of a compiled function, dynamo checks its guards: everything the traced graph
assumed about its inputs and the objects it read. `torch.compile(model)` guards every module of
the model (class, attributes, flags, hook dicts, each parameter's and buffer's dtype, shape and
strides): on the bundled target about 8,000 guards, measured at 1.6 ms of a 12 ms int4 token on
a 2-core AMD EPYC Zen 4 (torch profiler, "TorchDynamo Cache Lookup"). A loaded model's modules
do not change after the load (no training, no swapped weights: another quantization or dtype is
another model object), so those guards are dropped here (torch's own
`skip_guard_on_all_nn_modules_unsafe`), and what they protected is kept by other means:
- which model: each compiled model gets a code object, and a name, of its own, so its compiled
  graphs sit in a cache of their own (dynamo keeps them per code object) and its record of the
  sizes that changed is its own (kept per code name). A draft, a reloaded target, or any other
  model of the same class never runs another model's graphs nor inherits its dynamic sizes.
- hooks: not guarded before either (dynamo's `skip_nnmodule_hook_guards`): a forward that reads
  hidden states through hooks runs eagerly (engine/capture.py, mode "exact").
- a compile the dropped guards still break (dynamo left without a source for a size it made
  dynamic) gives way, for that model, to a compile with every guard (`GuardedFallback`).
Parameters are still read from the model at each call (dynamo lifts them into graph inputs), so
its weights are the model's own. Measured (same EPYC, bundled target, int4, 100 tokens after
160 cached): 12.4-12.8 ms a token before, 10.5-11.0 after; the lookup 1.7 ms -> 0.2-0.4 ms.
"""

from __future__ import annotations

import os
import types
import uuid

import torch

from specui.engine.warmup import RECOMPILE, compile_cache_dir

COMPILED = "_specui_compiled"  # where a model keeps its compiled callables (its id, {variant: callable})
RECOMPILES = 128  # torch.compile's recompiles per code object: one row's widths take two, beam rows one per rows
# count, capacity and width class (engine/rows.py mark_sizes: DSBD's up to 6 rows x 2 x a few capacities)


def compile_model(model: torch.nn.Module, variant: object = None, call=None):
    """The model's compiled callable, with the model's call signature: its own code object (so
    its own graph cache) and no guards on its modules, or, once that fails, one with dynamo's
    guards (`GuardedFallback`). Made once per model and `variant` and kept on the model, so every
    engine on it (a bench row each, a Compare tab's, the app's after a settings change) runs the
    same graphs: the caches they pass are inputs, not constants (a Warmup compiles on a scratch
    cache for the real one). `variant` names whatever else the trace reads that no guard sees
    (the attention's routing, read through the modules' config: engine/attention.py): each
    variant is a compile of its own. With a compile per engine the prepared GPU run's bundled
    section ran past its budget on an H100 (2026-11-27), and its CPU dry run took 383 s against
    120 s now (2-core Xeon, one run each). The recompile limit is raised once so a few shapes do
    not exhaust it (the default 8 would leave the rest silently eager). `call`: what is compiled
    in place of the model's own forward (a variant of its own: engine/hidden.py's forward that
    returns the hidden states beside the logits), called with the model's keyword arguments."""
    owner, made = model.__dict__.get(COMPILED, (None, {}))
    if owner != id(model):  # a deep copy of the model (another dtype) carries its source's: not its own
        made = {}
        model.__dict__[COMPILED] = (id(model), made)  # not a submodule or buffer: state_dict and .to() skip it
    if variant not in made:
        made[variant] = _compile(model, call or model)
    return made[variant]


# inductor's wrapper checks every input's size and strides at every call (and the outputs of the
# kernels it calls out to, twice each): 1002 checks a forward of the bundled 30-layer target, each
# a parameter or cache buffer whose shape dynamo's guards (or the model itself) already fix. At
# 0.54 us a check (2-core Xeon) that was 0.54 ms of a 12 ms compiled int4 token. vLLM's CPU backend
# and torch's own "reduce-overhead" mode turn them off too.
QUIET = {"size_asserts": False}


def _compile(model: torch.nn.Module, call):
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILES))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())  # inductor reads it at each compile
    unguarded = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # not in older torch
    if unguarded is None:
        return torch.compile(_own_code(call), options=QUIET)
    return GuardedFallback(call, torch.compile(_own_code(call), options={"guard_filter_fn": unguarded, **QUIET}))


class GuardedFallback:
    """The unguarded compile until a call of it fails, then torch.compile with every guard.
    Dropping the module guards can leave dynamo without a source for a size it made dynamic
    ("sources must not be empty for symbol ...": seen in CI while every model shared one record
    of dynamic sizes, which `_own_code` now keeps apart, and after a static cache grew while its
    window was a view of its slot offsets, which engine/static_cache.py's `_sizer` ended; this
    stays for any other such case), and
    that compile fails where the guarded one works. A call that fails
    in dynamo (not in a kernel: out of memory stays the caller's) is run again once on the guarded
    compile (it writes the same cache slots); a recompile that the "fail_on_recompile" stance
    refuses is not a failure and passes through."""

    def __init__(self, call, fast) -> None:
        self.call, self.fast, self.guarded = call, fast, None

    def __call__(self, *args, **kwargs):
        if self.guarded is None:
            try:
                return self.fast(*args, **kwargs)
            except (AssertionError, torch._dynamo.exc.TorchDynamoException) as e:  # dynamo's own failures only
                if RECOMPILE in str(e):
                    raise
                self.guarded = torch.compile(_own_code(self.call, "specui_guarded"))
        return self.guarded(*args, **kwargs)


def _own_code(model, kind: str = "specui_forward"):
    """A function that calls `model` (a model, or another callable over one), with a code object of its
    own and a name no other compile has: dynamo keeps compiled graphs per code object, and its
    automatic-dynamic record (which sizes it saw change, so compiles as symbols next time) per
    code *name* and place. Under one shared name every model's compile inherited every other's
    record, sizes of other models included, and a compile without module guards then failed now
    and then in CI ("sources must not be empty for symbol s79"), the guarded fallback with it,
    as it read the same record."""
    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    code = forward.__code__.replace(co_name=f"{kind}_{uuid.uuid4().hex[:12]}")  # its own cache and record
    return types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
