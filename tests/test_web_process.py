"""The web server's process imports no torch (issue 45): with the engine in a process of its own
(the default), the page's process lists methods, dtypes, quantizations and captures from
specui.settings and reads the rest from the engine as plain data. Measured on a 2-core EPYC:
importing the web side took 6.1 s and 414 MB with torch and transformers, 2.5 s and 135 MB
without."""

import subprocess
import sys

import torch

from specui.engine.methods import METHODS
from specui.errors import SpecUIError
from specui.service.chat_service import ChatService
from specui.service.engine_process import INFO_FIELDS, portable
from specui.settings import DTYPE_NAMES, METHOD_NAMES
from specui.weights.loading import DTYPES


def test_the_web_side_imports_no_torch():
    code = ("import sys, app, specui.webapp, specui.ui.chat_ui, specui.service.remote\n"
            "from specui.cli import build_parser, settings_from_args\n"
            "settings_from_args(build_parser().parse_args(['--method', 'dsbd']))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_names_the_page_offers_are_the_engines_and_the_loaders():
    assert set(METHOD_NAMES) == set(METHODS)
    assert all(isinstance(DTYPES[name], torch.dtype) for name in DTYPE_NAMES)  # each a real torch dtype


def test_a_library_error_crosses_the_pipe_as_a_message():
    """Unpickling a torch error's class would import torch into the web server's process."""
    sent = portable(torch.OutOfMemoryError("CPU out of memory"))
    assert type(sent) is SpecUIError and "OutOfMemoryError: CPU out of memory" in str(sent)
    assert type(portable(ValueError("v"))) is ValueError


def test_what_the_page_reads_of_the_engine_is_plain_data_the_service_has():
    assert "method_field_sets" in INFO_FIELDS
    sets = ChatService.method_field_sets.fget(None)
    assert set(sets) == set(METHODS)
    assert all(set(fields) == ChatService.method_fields(name) for name, fields in sets.items())
    assert set(sets["specdec++"]) == {"threshold", "gamma_max", "gamma"}


def test_every_methods_step_traces_are_plain_data(tiny_engine):
    """What crosses the pipe for each step: unpickling a trace that holds a tensor or a numpy
    number would import torch (or numpy's scalars) into the web server's process."""
    from specui.engine import GenerationRequest, SamplingConfig, make_method
    from specui.service.chat_service import method_params
    from specui.settings import ChatSettings

    ran = []
    for name in sorted(METHODS):
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)):
            try:
                method = make_method(name, **method_params(ChatSettings(method=name)))
                generation = tiny_engine.generate(GenerationRequest(prompt_ids=[5, 6, 7, 8], max_new_tokens=6,
                                                                    sampling=sampling), method)
                steps = list(generation)
            except SpecUIError:  # needs what the tiny pair lacks (an acceptance head, a batch)
                continue
            for step in steps:
                assert not foreign_modules(step), (name, foreign_modules(step))
            ran.append(name)
    assert {"autoregressive", "speculative", "opt-tree", "dsbd", "beam", "mcsd", "lookup", "tree"} <= set(ran)


def foreign_modules(obj) -> set[str]:
    """The torch / numpy modules unpickling `obj` would import: the modules of the classes and
    functions its pickle refers to (GLOBAL, or STACK_GLOBAL after its module and name strings)."""
    import pickle
    import pickletools

    modules, strings = set(), []
    for op, arg, _ in pickletools.genops(pickle.dumps(obj)):
        if op.name == "GLOBAL":
            modules.add(arg.split(" ")[0])
        elif op.name == "STACK_GLOBAL":
            modules.add(strings[-2])
        elif isinstance(arg, str):
            strings.append(arg)
    return {m for m in modules if m.split(".")[0] in ("torch", "numpy")}


def test_the_plain_data_check_sees_a_tensor_or_a_numpy_number():
    import numpy as np

    assert foreign_modules({"p": np.float32(0.5)}) and foreign_modules([torch.ones(1)])
    assert not foreign_modules({"p": 0.5, "text": "torch", "ids": [1, 2]})
