"""A cache folder that cannot be used (a read-only home, a container user without one, a path
through a file) used to end every start in a traceback at the kernels' build; SpecUI now caches
under a private folder of the temporary directory instead, says so once, and runs."""

from __future__ import annotations

import logging
import os
import tempfile

from specui.engine.paths import CACHE_VARIABLE, cache_root


def test_a_usable_cache_folder_is_used_and_nothing_is_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="specui"):
        assert cache_root() == tmp_path / "cache" / "specui"
    assert not (tmp_path / "cache").exists()  # asking makes nothing: the writers make what they write
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path / "cache") and not caplog.records
    assert CACHE_VARIABLE not in os.environ
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "mine"))  # the user's own choice comes first
    assert cache_root() == tmp_path / "mine"


def test_an_unusable_cache_folder_falls_back_to_a_private_temporary_one_said_once(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.WARNING, logger="specui"):
        root = cache_root()
        assert cache_root() == root  # the process (and those it starts) go on there: said once
    own = tmp_path / "tmp" / f"specui-cache-{os.getuid()}"
    assert root == own / "specui" and root.is_dir() and os.environ[CACHE_VARIABLE] == str(root)
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path / "a-file" / "cache")  # other libraries' caches untouched
    assert own.stat().st_mode & 0o777 == 0o700
    assert len(caplog.records) == 1 and "cache folder cannot be used" in caplog.records[0].getMessage()
    assert f"{tmp_path / 'a-file'} is not a folder" in caplog.records[0].getMessage()
    assert str(own) in caplog.records[0].getMessage()


def test_a_folder_that_cannot_be_written_to_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cache_root() == tmp_path / "tmp" / f"specui-cache-{os.getuid()}" / "specui"


def test_a_temporary_folder_open_to_others_is_not_trusted(tmp_path, monkeypatch):
    """What is cached includes compiled code the process loads: a folder of that name that other
    users may write to gives way to a fresh private one."""
    (tmp_path / "a-file").write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    shared = tmp_path / "tmp" / f"specui-cache-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    root = cache_root()
    assert shared not in root.parents and root.parent.name.startswith("specui-cache-") and root.is_dir()
    assert root.parent.stat().st_mode & 0o777 == 0o700
