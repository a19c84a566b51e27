"""The web server's process imports no torch (issue 45): with the engine in a process of its own
(the default), the page's process lists methods, dtypes, quantizations and captures from
specui.settings and reads the rest from the engine as plain data. Measured on a 2-core EPYC:
importing the web side took 6.1 s and 414 MB with torch and transformers, 2.5 s and 135 MB
without."""

import subprocess
import sys

from specui.engine.capture import CAPTURES as ENGINE_CAPTURES
from specui.engine.methods import METHODS
from specui.service.chat_service import ChatService
from specui.service.engine_process import INFO_FIELDS
from specui.settings import CAPTURES, DTYPE_NAMES, METHOD_NAMES, QUANTIZATIONS
from specui.weights.loading import DTYPES
from specui.weights.loading import QUANTIZATIONS as LOADER_QUANTIZATIONS


def test_the_web_side_imports_no_torch():
    code = ("import sys, app, specui.webapp, specui.ui.chat_ui, specui.service.remote\n"
            "from specui.cli import build_parser, settings_from_args\n"
            "settings_from_args(build_parser().parse_args(['--method', 'dsbd']))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_names_the_page_offers_are_the_engines_and_the_loaders():
    assert set(METHOD_NAMES) == set(METHODS)
    assert tuple(DTYPES) == DTYPE_NAMES and LOADER_QUANTIZATIONS == QUANTIZATIONS and ENGINE_CAPTURES == CAPTURES


def test_what_the_page_reads_of_the_engine_is_plain_data_the_service_has():
    assert "method_field_sets" in INFO_FIELDS
    sets = ChatService.method_field_sets.fget(None)
    assert set(sets) == set(METHODS)
    assert all(set(fields) == ChatService.method_fields(name) for name, fields in sets.items())
    assert set(sets["specdec++"]) == {"threshold", "gamma_max", "gamma"}
