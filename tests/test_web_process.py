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
