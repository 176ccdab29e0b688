"""Bad input, told apart from bugs: the one base class of every error a user can fix without changing the code.

A setting out of its range, a rollout file that does not hold what training needs, a model the engine cannot
train exactly, a server that answers in a form the client cannot use: each is raised where it is first seen, as a
subclass of :class:`UsageError`, with a message that says what is wrong, where (the setting, ``PATH:LINE``, the
rollout) and the fix. ``lightning-dta`` prints such a message as one line and exits with status 2, without a
traceback (``--traceback``, or ``LIGHTNING_DTA_TRACEBACK=1``, shows it); every other exception is a bug and keeps
its traceback.

Each subclass also derives from the built-in error it has always been (``ValueError``, ``TypeError``,
``RuntimeError``), so code that catches those keeps working.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input, not a bug (module docstring): the message says what, where and the fix."""


class ConfigError(UsageError, ValueError):
    """A setting is out of its range, unknown, or contradicts another setting or the data it meets."""
