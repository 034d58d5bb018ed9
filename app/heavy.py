"""Heavy computations on a page go through one server-wide queue (app/slots.py); a waiting user sees their place.

Use `with heavy.slot():` inside the cached function that computes (a cache hit then never waits), and call
`heavy.room()` where a page or fragment starts, for the place to show. The place is written outside Streamlit's
record of the cached function's elements, so a later cache hit does not replay an old "waiting" message.
"""
from __future__ import annotations

import functools
import ipaddress
import threading
from contextlib import contextmanager

import streamlit as st
from streamlit.errors import StreamlitAPIException

from app import access, slots
from kernels import settings

SLOTS = slots.from_env()
_room = threading.local()

try:  # Streamlit records elements written inside a cached function to replay them on a hit; not these
    from streamlit.runtime.scriptrunner_utils.script_run_context import in_cached_function as _recording
except ImportError:  # (an older or newer layout: the place is then not shown, the spinner still is)
    _recording = None


def room(where=None):
    """An empty line at the top of this run (a page or a fragment) where the queue place is shown if it waits;
    returns the line it replaces (a fragment gives it back when it ends: restore())."""
    before = getattr(_room, "box", None)
    _room.box = (where or st).empty()
    return before


def restore(box) -> None:
    _room.box = box


def fragment(fn):
    """st.fragment with its own queue line: a fragment's rerun cannot write to its page's line, so it opens one
    where it starts and gives the page's back when it ends."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        page_line = room()
        try:
            return fn(*args, **kwargs)
        finally:
            restore(page_line)
    return st.fragment(run)


def _write(method: str, text: str = "") -> None:
    box = getattr(_room, "box", None)
    if box is None or _recording is None:
        return
    token = _recording.set(False)
    try:
        getattr(box, method)(*([text] if text else []))
    except StreamlitAPIException:   # a box from another run (a fragment's rerun): the spinner alone shows
        pass
    finally:
        _recording.reset(token)


def owner() -> str | None:
    """Who asks, for the per-user limit (slots.Slots' per_owner). The header an authenticating proxy sets
    (MIXSCOPE_USER_HEADER, such as X-Forwarded-User) names the user only when the connection comes from one of the
    proxies the operator trusts (MIXSCOPE_TRUSTED_PROXIES): anyone else could send any value, a new user per tab.
    Otherwise the user is the connection's address; in serve mode the loopback is one user like any other, and
    outside it (`make run`, one user) it is not limited."""
    try:
        return user_key(st.context.ip_address, st.context.headers, access.serving())
    except Exception:   # noqa: BLE001 - outside a session (a test, a thread)
        return None


def user_key(address: str | None, headers, serving: bool) -> str | None:
    """owner()'s rule on plain values: address None is the loopback (Streamlit reports it so)."""
    try:
        ip = ipaddress.ip_address(address or "127.0.0.1")
    except ValueError:
        return f"address {address}"
    ip = getattr(ip, "ipv4_mapped", None) or ip
    header = settings.get("MIXSCOPE_USER_HEADER")
    if header and any(ip in net for net in settings.get("MIXSCOPE_TRUSTED_PROXIES")):
        user = headers.get(header)
        if user:
            return f"user {user}"
    if ip.is_loopback and not serving:
        return None
    return f"address {ip}"


@contextmanager
def slot(refuse: bool = True):
    """Hold one of the server's computation slots for the body, waiting in line (the place shown) or, when
    the line is full, stopping the run with "busy" (refuse=False: work under way, such as the next token of a
    generation, waits in line however long it is)."""
    waited = []

    def report(place: int) -> None:   # every second while waiting: a rewrite is also where a rerun can stop it
        running, waiting = SLOTS.state()
        _write("info", f"The server is busy ({running} computation(s) running, {waiting} waiting): you are number "
                       f"{place} in line. This page goes on by itself when your turn comes.")
        waited.append(place)

    try:
        with SLOTS.hold(report, poll_s=1.0, refuse=refuse, owner=owner()):
            if waited:
                _write("empty")
            yield
    except slots.Busy as e:
        _write("warning", f"The server is busy ({e}); try again in a minute.")
        st.stop()
