"""The server-wide queue for heavy computations on real pages (AppTest): a waiting page says its place and goes on,
a full queue answers "busy" and keeps nothing, and a later cache hit neither waits nor replays the message."""
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app import heavy
from app.slots import Slots
from kernels import settings

VIEWS = Path(__file__).resolve().parent.parent / "app" / "views"


@pytest.fixture
def server(monkeypatch):
    """A server of one slot and a queue of one; occupy() lets 'another session' hold the slot until release()."""
    slots = Slots(1, queue=1)
    monkeypatch.setattr(heavy, "SLOTS", slots)
    gate, threads = threading.Event(), []

    def other_session(held):
        with slots.hold():
            held.set()
            gate.wait(60)

    def occupy():
        held = threading.Event()
        threads.append(threading.Thread(target=other_session, args=(held,)))
        threads[-1].start()
        assert held.wait(10)

    yield slots, occupy, gate
    gate.set()
    for t in threads:
        t.join()


def attention(text: str) -> AppTest:
    """The Attention page opened (its sample text computed while the server is free), then given `text`."""
    at = AppTest.from_file(str(VIEWS / "2_Attention.py"), default_timeout=120)
    at.query_params["model"] = "mha"
    at.run()
    assert not at.exception
    at.text_area(key="text_area").input(text)
    return at


def test_a_waiting_page_says_its_place_then_computes(server, monkeypatch):
    slots, occupy, gate = server
    written = []
    real = heavy._write
    monkeypatch.setattr(heavy, "_write", lambda method, text="": (written.append((method, text)), real(method, text)))
    at = attention("A harbour town waited for its turn at the queue.")
    occupy()
    threading.Timer(2.0, gate.set).start()
    t0 = time.monotonic()
    at.run()
    assert time.monotonic() - t0 >= 1.5 and not at.exception
    assert any(m == "info" and "number 1 in line" in t for m, t in written)
    assert written[-1] == ("empty", "")                         # the line is cleared once its turn came
    assert at.get("plotly_chart") and not any("in line" in i.value for i in at.info)
    written.clear()
    gate.clear()
    occupy()   # the slot busy again: the same text is a cache hit, which neither waits nor replays the message
    t0 = time.monotonic()
    at.run()
    assert time.monotonic() - t0 < 1.0 and not at.exception and not written
    assert at.get("plotly_chart") and not any("in line" in i.value for i in at.info)
    gate.set()


def test_a_full_queue_answers_busy_and_keeps_nothing(server):
    slots, occupy, gate = server
    at = attention("Nobody else can wait in this line today.")
    occupy()
    def queued_session():
        with slots.hold(poll_s=0.01):
            pass

    waiting = threading.Thread(target=queued_session)
    waiting.start()
    deadline = time.monotonic() + 10
    while slots.state() != (1, 1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    at.run()
    assert not at.exception and any("The server is busy" in w.value for w in at.warning)
    assert not at.get("plotly_chart")
    gate.set()
    waiting.join()
    at.run()   # once the server is free the same text computes (the refusal was not cached)
    assert not at.exception and at.get("plotly_chart") and not at.warning


def test_a_user_past_their_share_is_told_so(monkeypatch):
    """One user's other tab holds the only place one user may have: this page says so and keeps nothing."""
    slots, gate, held = Slots(1, queue=8, per_owner=1), threading.Event(), threading.Event()
    monkeypatch.setattr(heavy, "SLOTS", slots)
    monkeypatch.setattr(heavy, "owner", lambda: "ann")
    at = attention("One person, two tabs, one place in the line.")

    def other_tab():
        with slots.hold(owner="ann"):
            held.set()
            gate.wait(60)

    tab = threading.Thread(target=other_tab)
    tab.start()
    assert held.wait(10)
    try:
        at.run()
        assert any("you already have 1 computation" in w.value for w in at.warning) and not at.get("plotly_chart")
    finally:
        gate.set()
        tab.join()


def test_the_user_is_the_trusted_proxys_header_else_the_connections_address(monkeypatch):
    from types import SimpleNamespace
    fake = SimpleNamespace(context=SimpleNamespace(headers={"X-Forwarded-User": "ann"}, ip_address="10.0.0.7"))
    monkeypatch.setattr(heavy, "st", fake)
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.delenv("MIXSCOPE_USER_HEADER", raising=False)
    monkeypatch.delenv("MIXSCOPE_TRUSTED_PROXIES", raising=False)
    assert heavy.owner() == "address 10.0.0.7"
    monkeypatch.setenv("MIXSCOPE_USER_HEADER", "X-Forwarded-User")
    assert heavy.owner() == "address 10.0.0.7"        # a header from an address nobody named as a proxy: forged
    seen = set()
    for forged in ("a", "b", "c", "d", "e", "f", "g"):  # seven tabs, each its own header value: still one user
        fake.context.headers = {"X-Forwarded-User": forged}
        seen.add(heavy.owner())
    assert seen == {"address 10.0.0.7"}
    monkeypatch.setenv("MIXSCOPE_TRUSTED_PROXIES", "10.0.0.0/24, 192.168.1.9")
    assert heavy.owner() == "user g"
    fake.context.headers = {}
    assert heavy.owner() == "address 10.0.0.7"        # the proxy did not say who: the proxy's own key
    fake.context.ip_address = "10.0.1.7"              # outside the trusted network
    fake.context.headers = {"X-Forwarded-User": "ann"}
    assert heavy.owner() == "address 10.0.1.7"
    monkeypatch.delenv("MIXSCOPE_TRUSTED_PROXIES")
    for local in ("127.0.0.1", "::1", "::ffff:127.0.0.1", None):
        fake.context.ip_address = local
        assert heavy.owner() is not None              # serve mode: the loopback is limited like anyone
        monkeypatch.setenv("MIXSCOPE_SERVE", "0")
        assert heavy.owner() is None                  # `make run`: this machine's one user, not limited
        monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_TRUSTED_PROXIES", "127.0.0.1")
    fake.context.ip_address = None                    # a proxy on this machine, trusted
    assert heavy.owner() == "user ann"


def test_trusted_proxies_setting_parses_networks_and_refuses_junk(monkeypatch):
    import ipaddress
    monkeypatch.setenv("MIXSCOPE_TRUSTED_PROXIES", "10.0.0.1,fd00::/8")
    assert settings.get("MIXSCOPE_TRUSTED_PROXIES") == (ipaddress.ip_network("10.0.0.1/32"),
                                                        ipaddress.ip_network("fd00::/8"))
    monkeypatch.setenv("MIXSCOPE_TRUSTED_PROXIES", "my-proxy")
    with pytest.raises(ValueError, match="MIXSCOPE_TRUSTED_PROXIES must be comma-separated IP addresses"):
        settings.get("MIXSCOPE_TRUSTED_PROXIES")


def test_a_forwarded_for_header_never_replaces_the_connections_address(monkeypatch):
    """Streamlit serves through uvicorn, whose proxy-header middleware by default believes X-Forwarded-For from the
    loopback: a user on the server's own machine could then claim a new address per tab (or a trusted proxy's).
    The app's command turns that off."""
    import asyncio

    import uvicorn
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from models import cli

    def address_seen(trusted) -> str:
        seen = {}

        async def app(scope, receive, send):
            seen["client"] = scope["client"]
        scope = {"type": "websocket", "client": ("127.0.0.1", 5000), "scheme": "ws",
                 "headers": [(b"x-forwarded-for", b"203.0.113.7")]}
        asyncio.run(ProxyHeadersMiddleware(app, trusted_hosts=trusted)(scope, None, None))
        return seen["client"][0]

    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    assert address_seen(uvicorn.Config(app=None).forwarded_allow_ips) == "203.0.113.7"   # uvicorn's default
    for serve in (False, True):
        _, env = cli.app_command("127.0.0.1", 8501, serve=serve)
        monkeypatch.setenv("FORWARDED_ALLOW_IPS", env["FORWARDED_ALLOW_IPS"])
        assert address_seen(uvicorn.Config(app=None).forwarded_allow_ips) == "127.0.0.1"
