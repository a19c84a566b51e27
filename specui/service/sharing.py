"""Who may do what on the app (issue 46): the owner's own app, or a link handed out.

The role follows how the app was launched, never the client's address (a share link's
requests arrive from the local tunnel): served on loopback only, without --share, everyone
is the **owner** and can do everything, exactly as before. Launched with --share or on
another --host, everyone is a **visitor**: they chat, switch methods and settings, inspect
steps and export traces, within the visitor limits, but cannot load models, measure, or see
anything of the owner's filesystem. `--allow-remote-admin`, or a user named `admin user:pass`
in the --auth file, makes them owners again, on purpose.

Also here: the web app's flags, and --auth's users (a pair or a file). No torch, no Gradio."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace
from pathlib import Path

from specui.errors import SpecUIError
from specui.service.fair import MAX_WAITING_PER_SESSION
from specui.settings import ChatSettings

OWNER, VISITOR = "owner", "visitor"
LOADING_OFF = "model loading is off for visitors of a shared link"
MEASURING_OFF = "measuring is off for visitors of a shared link"
VISITOR_MAX_NEW_TOKENS = 1024
VISITOR_MAX_REPLIES = 4  # ems-sd rows one visitor's message may take
VISITOR_MAX_CHARS = 200_000  # a visitor's conversation (system prompt, history, message), in characters
VISITOR_CAN = ("chat", "switch methods and settings", "inspect steps", "export traces", "compare methods")
VISITOR_CANNOT = ("load models", "measure (cost profile, quantization options, machine report)", "change threads")


@dataclass(frozen=True)
class Access:
    shared: bool = False  # launched for others: --share, or a --host other than loopback
    admins: frozenset[str] = frozenset()  # users of the --auth file named as admins
    remote_admin: bool = False  # --allow-remote-admin: every user is an owner
    visitor_max_new_tokens: int = VISITOR_MAX_NEW_TOKENS

    @classmethod
    def for_launch(cls, host: str, share: bool, admins=(), remote_admin: bool = False,
                   visitor_max_new_tokens: int = VISITOR_MAX_NEW_TOKENS) -> Access:
        return cls(share or not is_loopback(host), frozenset(admins), remote_admin, visitor_max_new_tokens)

    def role(self, request=None) -> str:
        """The role of a request (gr.Request or None): owner unless the app is shared and its
        user is no admin."""
        if not self.shared or self.remote_admin:
            return OWNER
        return OWNER if getattr(request, "username", None) in self.admins else VISITOR

    def defaults_for(self, role: str, defaults: ChatSettings) -> ChatSettings:
        """The settings a request of `role` starts from: the owner's flags, within the visitor limits."""
        if role == OWNER:
            return defaults
        return replace(defaults, max_new_tokens=min(defaults.max_new_tokens, self.visitor_max_new_tokens),
                       replies=min(defaults.replies, VISITOR_MAX_REPLIES))

    def limit(self, settings: ChatSettings, role: str) -> ChatSettings:
        """The settings unchanged, or a SpecUIError naming the visitor limit they pass."""
        if role == OWNER:
            return settings
        if settings.max_new_tokens > self.visitor_max_new_tokens:
            raise SpecUIError(f"max new tokens is at most {self.visitor_max_new_tokens:,} for visitors of a shared "
                              f"link, got {settings.max_new_tokens:,}")
        if settings.replies > VISITOR_MAX_REPLIES:
            raise SpecUIError(f"alternative replies: at most {VISITOR_MAX_REPLIES} for visitors of a shared link, "
                              f"got {settings.replies}")
        return settings

    @staticmethod
    def limit_text(chars: int) -> None:
        """A SpecUIError when a visitor's conversation is longer than the visitor limit."""
        if chars > VISITOR_MAX_CHARS:
            raise SpecUIError(f"the conversation is at most {VISITOR_MAX_CHARS:,} characters for visitors of a shared "
                              f"link, got {chars:,}: start a new chat or send less")

    def describe(self, role: str) -> dict:
        """What `role` may do here (the API's /info)."""
        if role == OWNER:
            return {"role": OWNER, "shared": self.shared, "can": ["everything"], "cannot": [], "limits": {}}
        return {"role": VISITOR, "shared": True, "can": list(VISITOR_CAN), "cannot": list(VISITOR_CANNOT),
                "limits": {"max_new_tokens": self.visitor_max_new_tokens, "replies": VISITOR_MAX_REPLIES,
                           "characters": VISITOR_MAX_CHARS, "running_per_session": 1,
                           "waiting_per_session": MAX_WAITING_PER_SESSION}}

    def visitor_note(self) -> str:
        return (f"**Shared link: you are a visitor.** You can {', '.join(VISITOR_CAN)} (up to "
                f"{self.visitor_max_new_tokens:,} new tokens a reply, {VISITOR_MAX_REPLIES} alternative replies, "
                "one reply running and two waiting at a time). Loading models, measuring and the machine report "
                "are for the owner; the loaded pair is shown read-only.")


def is_loopback(host: str | None) -> bool:
    host = (host or "").strip().strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


_PATH = re.compile(r"(?<![\w.:/-])(?:~|[A-Za-z]:\\|/)[^\s'\"`,;()]*")


def public_label(label: str) -> str:
    """A model's label as a visitor sees it: a local model by its folder or file name only."""
    text = str(label)
    if _PATH.fullmatch(text) or Path(text).expanduser().exists():
        return Path(text).name or text
    return text


def scrub_paths(text: str) -> str:
    """The text with every absolute or home path replaced (what a visitor may read of a note)."""
    return _PATH.sub("<path>", str(text))


@dataclass(frozen=True)
class Credentials:
    pairs: list[tuple[str, str]]
    admins: frozenset[str]


def parse_credentials(value: str | None) -> Credentials | None:
    """--auth: 'user:pass', or a file of 'user:pass' lines ('admin user:pass' for an owner of a
    shared app; '#' comments). The message of a bad file names the line, never its password."""
    if not value:
        return None
    path = Path(value)
    try:
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecUIError(f"--auth: could not read the credentials file ({type(e).__name__})") from None
    where = "--auth FILE" if lines is not None else "--auth"
    pairs, admins = [], set()
    for number, line in enumerate(lines if lines is not None else [value], 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        admin = bool(re.match(r"admin\s+\S", line))
        user, sep, password = (line.split(None, 1)[1] if admin else line).partition(":")
        user, password = user.strip(), password.strip()
        if not sep or not user or not password:
            at = f" line {number}" if lines is not None else ""
            raise SpecUIError(f"{where}{at}: needs user:pass (or 'admin user:pass'; a file of such lines)")
        pairs.append((user, password))
        if admin:
            admins.add(user)
    if not pairs:
        raise SpecUIError(f"{where}: needs user:pass (or a file of user:pass lines); found no users")
    return Credentials(pairs, frozenset(admins))


def add_web_flags(ap: argparse.ArgumentParser) -> None:
    u = ap.add_argument_group("web app")
    u.add_argument("--host", default="127.0.0.1", help="where to listen (not loopback: everyone is a visitor)")
    u.add_argument("--port", type=int, default=None,
                   help="where to listen (default: 7860, or the first free port up to 7959 where it is taken)")
    u.add_argument("--share", action="store_true",
                   help="public Gradio link; needs --auth (or --public); its users are visitors")
    u.add_argument("--auth", help="user:pass, or a file holding user:pass lines ('admin user:pass': an owner)")
    u.add_argument("--public", action="store_true", help="allow --share without --auth, on purpose")
    u.add_argument("--allow-remote-admin", action="store_true",
                   help="let every user of a shared app load models and measure, as the owner")
    u.add_argument("--visitor-max-new-tokens", type=int, default=VISITOR_MAX_NEW_TOKENS,
                   help="the longest reply a visitor of a shared app may ask for")
    u.add_argument("--queue", type=int, default=16, help="max queued requests")
    u.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: measured at start when the app serves a browser on this machine, "
                        "torch's default otherwise)")
    u.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so the web server never holds it up "
                        "(--no-engine-process: one process, as before)")
