"""Errors meant for the person using the app: one clear message, never a traceback."""


class SpecUIError(Exception):
    """A problem with the user's input or environment, with a message written for them."""
