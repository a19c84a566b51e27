"""The app's start: the port is checked before any model loads (a taken one used to end the start
in a traceback after the models had loaded, 40 s here; without --port a second SpecUI takes the next
free one), and Ctrl+C while the models load stops it without a traceback."""

from __future__ import annotations

import socket

import pytest

from specui.errors import SpecUIError
from specui.webapp import choose_port


@pytest.fixture()
def taken_port():
    """A port another program listens on (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_named_port_that_is_taken_is_refused_with_what_to_do(taken_port):
    with pytest.raises(SpecUIError, match=rf"cannot serve on 127.0.0.1:{taken_port} \(.*in use\).*--port N"):
        choose_port("127.0.0.1", taken_port)
    with pytest.raises(SpecUIError, match=r"--port must be in \[1, 65535\], got 70000"):
        choose_port("127.0.0.1", 70000)


def test_without_a_port_the_first_free_one_is_taken_and_said(taken_port, capsys):
    from specui.webapp import _bind_problem

    free = next(p for p in range(taken_port + 1, taken_port + 50) if _bind_problem("127.0.0.1", p) is None)
    assert choose_port("127.0.0.1", None, (taken_port, taken_port + 50)) == free
    assert f"port {taken_port} is taken" in capsys.readouterr().err
    with pytest.raises(SpecUIError, match=r"ports .* tried"):  # every port of the range taken
        choose_port("127.0.0.1", None, (taken_port, taken_port))


def test_a_host_this_machine_does_not_have_is_said_at_once():
    from specui.webapp import _bind_problem

    if _bind_problem("203.0.113.7", 0) is None:
        pytest.skip("this machine lets a server listen on addresses it does not have (ip_nonlocal_bind)")
    with pytest.raises(SpecUIError, match=r"cannot serve on 203\.0\.113\.7: .*check --host"):
        choose_port("203.0.113.7", None)  # TEST-NET-3: never an address of this machine


@pytest.fixture()
def quiet_start(monkeypatch):
    """app.main as on a machine without a CPU quota, its log handler (added on this test's stderr) gone after."""
    import logging

    from specui.engine import host_cpus

    monkeypatch.setattr(logging.getLogger("specui"), "handlers", [])
    monkeypatch.setattr(host_cpus, "threads_for_quota", lambda: None)


def test_the_app_refuses_a_taken_port_before_loading_anything(taken_port, capsys, quiet_start):
    import app

    assert app.main(["--port", str(taken_port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot serve on 127.0.0.1:{taken_port}" in err and "loading models" not in err


def test_ctrl_c_while_the_models_load_stops_the_app_without_a_traceback(monkeypatch, capsys, quiet_start):
    import app
    from specui import webapp

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(webapp, "launch", interrupted)
    assert app.main([]) == 130
    assert capsys.readouterr().err.strip() == "stopped"


class _Demo:
    """demo.launch's surface: the first launch finds its port taken (another SpecUI started meanwhile)."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.closed = 0

    def launch(self, server_port: int, **kwargs) -> None:
        self.ports.append(server_port)
        if len(self.ports) == 1:
            raise OSError(f"Cannot find empty port in range: {server_port}-{server_port}.")

    def close(self) -> None:
        self.closed += 1


def test_a_port_taken_between_the_check_and_the_launch_gives_way_unless_named(taken_port, monkeypatch):
    from specui import webapp

    monkeypatch.setattr(webapp, "choose_port", lambda host, port: taken_port + 1)
    demo = _Demo()
    webapp._launch_local(demo, {"server_port": taken_port}, "127.0.0.1", named_port=False)
    assert demo.ports == [taken_port, taken_port + 1] and demo.closed == 1
    with pytest.raises(SpecUIError, match=rf"cannot serve on 127.0.0.1:{taken_port} \(Cannot find empty port"):
        webapp._launch_local(_Demo(), {"server_port": taken_port}, "127.0.0.1", named_port=True)
