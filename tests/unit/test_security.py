"""The security checks as pure functions (runtime/security.py): identities, the policy parser
(fuzzed), content-based authorisation by covering, and the client-id binding."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.client import ClientError, Credentials, connect
from canopy_broker.core.filters import Filter
from canopy_broker.pki import Authority, LocalPki
from canopy_broker.runtime.security import (
    BROKER,
    CLIENT,
    AccessError,
    Identity,
    Policy,
    SecurityError,
    TlsFiles,
    authenticate_client,
    check_link_peer,
    identity_of,
    token_digest,
)
from canopy_broker.runtime.server import Broker
from tests.unit.test_runtime_broker import (
    MakeBroker,
    addr,
    collect,
    eventually,
    link,
    make_broker,
    settled,
)

__all__ = ["make_broker"]

POLICY = Policy.from_dict(
    {
        "default": "deny",
        "principals": [
            {"name": "ops", "clients": ["*"]},
            {
                "name": "sensors",
                "publish": ["kind = 'temp'"],
                "subscribe": [],
                "tokenSha256": token_digest("t0k3n"),
            },
            {"name": "dash", "subscribe": ["kind = 'temp' and site = 'lab'", "kind = 'alarm'"]},
        ],
    }
)


def test_identity_from_a_certificate_issued_by_the_overlay_ca() -> None:
    ca = Authority.create()
    pem, _key = ca.issue(Identity(BROKER, "b7"), hosts=("127.0.0.1", "b7.svc"))
    cert = x509.load_pem_x509_certificate(pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert uris == ["canopy://broker/b7"]
    # What ssl.getpeercert() gives, and what identity_of makes of it.
    peercert = {"subjectAltName": (("DNS", "b7.svc"), ("URI", uris[0]))}
    assert identity_of(peercert) == Identity(BROKER, "b7")
    assert identity_of({"subjectAltName": (("URI", "spiffe://x/y"),)}) is None
    assert identity_of({"subjectAltName": (("URI", "canopy://admin/x"),)}) is None
    assert identity_of(None) is None


def test_a_link_needs_the_certificate_of_the_broker_it_names() -> None:
    check_link_peer(Identity(BROKER, "b1"), "b1", secure=True)
    check_link_peer(None, "b1", secure=False)  # plaintext (--insecure): nothing to check
    with pytest.raises(AccessError) as none:
        check_link_peer(None, "b1", secure=True)
    assert none.value.code == "unauthenticated"
    for wrong in (Identity(BROKER, "b2"), Identity(CLIENT, "b1")):
        with pytest.raises(AccessError) as info:
            check_link_peer(wrong, "b1", secure=True)
        assert info.value.code == "wrong-identity"


def test_clients_are_bound_to_their_principal() -> None:
    p = authenticate_client(Identity(CLIENT, "sensors"), None, "sensors/3", POLICY, secure=True)
    assert (p.name, p.via) == ("sensors", "certificate")
    p = authenticate_client(None, "t0k3n", "sensors", POLICY, secure=True)
    assert (p.name, p.via) == ("sensors", "token")
    ops = authenticate_client(Identity(CLIENT, "ops"), None, "anything", POLICY, secure=True)
    assert ops.permissions.may_use_id("ops", "sensors")  # clients: ["*"]
    cases: list[tuple[Identity | None, Any, str, str]] = [
        (Identity(CLIENT, "sensors"), None, "dash", "forbidden"),  # another's id
        (Identity(CLIENT, "sensors"), None, "sensorsX", "forbidden"),  # not NAME/...
        (Identity(CLIENT, "stranger"), None, "stranger", "forbidden"),  # default: deny
        (None, "wrong", "sensors", "unauthenticated"),
        (None, None, "sensors", "unauthenticated"),
        (Identity(BROKER, "b1"), None, "b1", "wrong-identity"),  # a broker is no client
    ]
    for identity, token, cid, code in cases:
        with pytest.raises(AccessError) as info:
            authenticate_client(identity, token, cid, POLICY, secure=True)
        assert info.value.code == code, (identity, token, cid)


def test_content_based_authorisation_is_covering() -> None:
    dash = POLICY.permissions("dash")
    sensors = POLICY.permissions("sensors")
    assert dash is not None and sensors is not None
    assert dash.may_subscribe(Filter.parse("kind = 'temp' and site = 'lab' and v > 30"))
    assert dash.may_subscribe(Filter.parse("kind = 'alarm' and level >= 2"))
    assert not dash.may_subscribe(Filter.parse("kind = 'temp'"))  # wider than allowed
    assert not dash.may_subscribe(Filter.parse("true"))
    assert dash.may_publish({"anything": 1})  # publish left out: anything
    assert not sensors.may_subscribe(Filter.parse("kind = 'temp'"))  # []: nothing
    assert sensors.may_publish({"kind": "temp", "v": 3})
    assert not sensors.may_publish({"kind": "humidity"})


def test_policy_errors_name_the_entry() -> None:
    bad: list[tuple[object, str]] = [
        ([], "a policy is a mapping"),
        ({"principals": [{"name": "x", "publish": ["v >"]}]}, r"principals\[0\]\.publish"),
        ({"principals": [{"name": "x", "colour": 1}]}, "unknown keys"),
        ({"principals": [{"name": "x"}, {"name": "x"}]}, "listed twice"),
        ({"default": "maybe"}, "allow or deny"),
        ({"principals": [{"name": "x", "tokenSha256": "abc"}]}, "64 hex"),
    ]
    for doc, message in bad:
        with pytest.raises(SecurityError, match=message):
            Policy.from_dict(doc)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
entries = st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=8)},
    optional={
        "clients": st.lists(st.text(max_size=8), max_size=3) | json_values,
        "publish": st.lists(st.sampled_from(["x = 1", "x >", "y < 2 and z = 'a'", ""]), max_size=3),
        "subscribe": st.none() | st.lists(st.text(max_size=15), max_size=3),
        "tokenSha256": st.text(max_size=70),
    },
)


@settings(max_examples=300)
@given(
    doc=json_values
    | st.fixed_dictionaries(
        {},
        optional={
            "default": st.sampled_from(["allow", "deny", "x"]),
            "principals": st.lists(entries, max_size=4) | json_values,
        },
    )
)
def test_fuzzed_policies_parse_or_fail_clearly(doc: object) -> None:
    """Any document: a policy, or SecurityError with a message; never another exception."""
    try:
        policy = Policy.from_dict(doc)
    except SecurityError as exc:
        assert str(exc)
        return
    for name in policy.principals:
        assert policy.permissions(name) is not None


# --------------------------------------------------------------------------- rotation


async def test_rotated_certificates_rekey_the_links_without_losing_a_notification(
    make_broker: MakeBroker, tmp_path: Path
) -> None:
    """New certificates from a new CA are written over the old files while a publisher on a
    streams to a subscriber on z: both brokers load them, drop each link connection once, and
    the link resumes on a connection that shows the new certificates; nothing is lost,
    duplicated or reordered."""
    pki = LocalPki(tmp_path / "pki").ensure()
    files = {b: pki.broker(b) for b in ("a", "z")}
    a = await make_broker("a", tls=files["a"], policy_file=str(pki.policy_path))
    z = await make_broker("z", tls=files["z"], policy_file=str(pki.policy_path))
    await link(a, z)
    creds = Credentials.from_pki(pki.dir)
    async with (
        await connect(addr(z), "sub", credentials=creds) as sub,
        await connect(addr(a), "pub", credentials=creds) as pub,
    ):
        await sub.subscribe("n >= 0")
        await settled(a, z)
        total = 3000
        for n in range(1, total + 1):
            pub.publish_nowait({"n": n})
            if n == 1000:
                await pub.flush()
                new_ca = Authority.create("rotated CA")
                bundle = pki.ca_path.read_bytes() + new_ca.cert_pem  # old and new, for a while
                for b, f in files.items():
                    cert, key = new_ca.issue(Identity(BROKER, b), ("127.0.0.1",))
                    assert f.cert is not None and f.key is not None
                    f.key.write_bytes(key)
                    f.cert.write_bytes(cert)
                pki.ca_path.write_bytes(bundle)
            if n % 200 == 0:
                await pub.flush()
                await asyncio.sleep(0.05)
        await eventually(lambda: a.metrics.tls_reloads._value.get() == 1)
        await eventually(lambda: z.metrics.tls_reloads._value.get() == 1)
        got = await collect(sub, total, within=30)
        assert [n.seq for n in got] == list(range(1, total + 1))
        await settled(a, z)

    def issuer(b: Broker, peer: str) -> str:
        conn = b.links[peer].conn
        assert conn is not None and conn.transport is not None
        cert = conn.transport.get_extra_info("peercert")
        return dict(x[0] for x in cert["issuer"])["commonName"]

    assert issuer(a, "z") == issuer(z, "a") == "rotated CA"
    assert a.links["z"].connects > 1


# --------------------------------------------------------------------------- listeners


async def test_separate_listeners_with_their_own_client_material(
    make_broker: MakeBroker, tmp_path: Path
) -> None:
    """Links on a port of their own with the overlay's CA; z's client port shows a certificate
    of another CA ("the one our clients trust") and takes client certificates of that CA. A
    client with the overlay's credentials does not trust z's client port; one with the client
    CA's does, and what it gets came over the link; rotating the client material reloads the
    client port and leaves the links alone."""
    pki = LocalPki(tmp_path / "pki").ensure()
    public = Authority.create("client-facing CA")
    d = tmp_path / "client-tls"
    d.mkdir()
    (d / "ca.crt").write_bytes(public.cert_pem)
    cert, key = public.issue(Identity(BROKER, "z"), ("127.0.0.1",))
    (d / "tls.crt").write_bytes(cert)
    (d / "tls.key").write_bytes(key)
    mine, my_key = public.issue(Identity(CLIENT, "canopy"))
    (d / "me.pem").write_bytes(mine)
    (d / "me.key").write_bytes(my_key)
    client_tls = TlsFiles(d / "ca.crt", d / "tls.crt", d / "tls.key")
    a = await make_broker("a", tls=pki.broker("a"), link_port=0)
    z = await make_broker("z", tls=pki.broker("z"), link_port=0, client_tls=client_tls)
    assert z.link_address is not None and z.address is not None
    assert z.advertised == "{}:{}".format(*z.link_address) != addr(z)
    a.add_link("z", z.advertised)
    assert await a.wait_link_up("z", 5.0)
    overlay_creds = Credentials.from_pki(pki.dir)
    with pytest.raises((ssl.SSLError, ConnectionError, ClientError)):
        await connect(addr(z), "sub", credentials=overlay_creds, failover_within=0)
    creds = Credentials(d / "ca.crt", d / "me.pem", d / "me.key")
    async with (
        await connect(addr(z), "sub", credentials=creds) as sub,
        await connect(addr(a), "pub", credentials=overlay_creds) as pub,
    ):
        await sub.subscribe("n >= 0")
        await settled(a, z)
        for n in range(1, 101):
            pub.publish_nowait({"n": n})
        got = await collect(sub, 100, within=10)
        assert [n.seq for n in got] == list(range(1, 101))
    connects = z.links["a"].connects
    cert, key = public.issue(Identity(BROKER, "z"), ("127.0.0.1",))
    (d / "tls.key").write_bytes(key)
    (d / "tls.crt").write_bytes(cert)
    await eventually(lambda: z.metrics.tls_reloads._value.get() == 1)
    assert z.links["a"].connects == connects  # the links' material did not change
