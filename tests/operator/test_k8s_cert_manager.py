"""Certificates from a cert-manager Issuer (``spec.security.issuerRef``, issue 14 item 6) through
the real operator (kopf on kmock's emulator, real broker processes). cert-manager itself is
played by a small loop that does what its controller does with a ``Certificate``: issue the
identity it names into its Secret, with the issuer's CA in ``ca.crt``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from cryptography import x509

from canopy_broker.client import connect
from canopy_broker.pki import Authority
from canopy_broker.runtime.security import Identity
from canopy_operator.backends.certs import (
    SCRAPE_NAME,
    b64,
    certificates_path,
    needs_renewal,
    secret_bytes,
)
from canopy_operator.backends.kube import overlay_path
from canopy_operator.backends.manifests import security_of
from canopy_operator.model.topology import SpecError
from tests.operator import test_k8s_operator
from tests.operator.k8s_harness import (
    NS,
    CanopyEmulator,
    condition,
    objects,
    overlay_manifest,
    until,
)
from tests.operator.test_k8s_operator import Cluster, events, verbs_granted, verbs_used

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]

cluster = test_k8s_operator.cluster  # the same fixture: emulator, kubelet, operator thread

ISSUER = {"name": "corp-ca", "kind": "ClusterIssuer"}


@contextlib.asynccontextmanager
async def cert_manager(cluster: Cluster, ca: Authority) -> AsyncIterator[list[str]]:
    """cert-manager's part: every Certificate whose Secret is missing gets it, issued by
    ``ca``; yields the names of the Secrets issued so far."""
    issued: list[str] = []

    async def loop() -> None:
        while True:
            for cert in objects(cluster.emulator, "certificates"):
                ns, spec = cert["metadata"]["namespace"], cert["spec"]
                path = f"/api/v1/namespaces/{ns}/secrets"
                if await cluster.api.get(f"{path}/{spec['secretName']}") is not None:
                    continue
                kind, _, name = spec["uris"][0].removeprefix("canopy://").partition("/")
                pem, key = ca.issue(Identity(kind, name), spec.get("dnsNames", ()))
                data = {"ca.crt": b64(ca.cert_pem), "tls.crt": b64(pem), "tls.key": b64(key)}
                body: dict[str, Any] = {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": spec["secretName"], "namespace": ns},
                    "type": "kubernetes.io/tls",
                    "data": data,
                }
                await cluster.api.create(path, body)
                name = cert["metadata"]["name"]
                if await cluster.api.get(certificates_path(ns, name)) is None:
                    # Deleted while issued (the list above is a moment old; the operator
                    # deletes a removed broker's Certificate, then its Secret): the Secret
                    # goes too, as cert-manager's owner reference on it would have it. CI once
                    # found the removed broker's Secret made anew after the operator was done.
                    await cluster.api.delete(f"{path}/{spec['secretName']}")
                    continue
                issued.append(spec["secretName"])
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield issued
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_issuer_that_has_not_issued_yet_holds_the_overlay_then_it_converges(
    cluster: Cluster,
) -> None:
    """Without cert-manager answering, the overlay waits with a condition and an Event that
    name the Certificate to look at, and no broker runs; once the issuer issues, the overlay
    converges on certificates of the issuer's CA only: no CA Secret of the operator's, links up
    over mutual TLS, the operator's admin calls verified against the issuer's CA, a client with
    the client Secret publishes and subscribes. Removing a broker removes its Certificate."""
    cluster.start_operator(certificate_wait=0.5, retry_delay=0.5)
    body = overlay_manifest("cm", ["a", "b", "c"], [("a", "b"), ("b", "c")])
    body["spec"]["security"] = {"issuerRef": ISSUER}
    await cluster.apply(body)
    pending = await until(
        lambda: events(cluster.emulator, "CertificatesPending"), 20, "a CertificatesPending Event"
    )
    assert "kubectl describe certificate cm-client" in pending[0]["message"]
    assert "ClusterIssuer corp-ca" in pending[0]["message"]
    obj = await cluster.overlay("cm")
    assert condition(obj, "Ready")["reason"] == "CertificatesPending"
    assert not objects(cluster.emulator, "pods")  # nothing runs without its certificate

    corp = Authority.create("corp CA")
    async with cert_manager(cluster, corp) as issued:
        obj = await cluster.ready("cm", within=60)
        assert sorted(issued) == ["cm-a-tls", "cm-b-tls", "cm-c-tls", "cm-client"]
        secrets = {x["metadata"]["name"]: x for x in objects(cluster.emulator, "secrets")}
        assert "cm-ca" not in secrets  # the operator holds no CA of its own here
        certificates = {c["metadata"]["name"]: c for c in objects(cluster.emulator, "certificates")}
        assert sorted(certificates) == sorted(issued)
        for name, c in certificates.items():
            assert c["spec"]["issuerRef"] == {**ISSUER, "group": "cert-manager.io"}
            assert c["spec"]["secretName"] == name
            assert c["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
            cert = x509.load_pem_x509_certificate(secret_bytes(secrets[name], "tls.crt"))
            cert.verify_directly_issued_by(corp.cert)
            assert not needs_renewal(secret_bytes(secrets[name], "tls.crt"))
        assert certificates["cm-client"]["spec"]["uris"] == ["canopy://client/canopy"]
        assert certificates["cm-b-tls"]["spec"]["uris"] == ["canopy://broker/b"]
        assert SCRAPE_NAME in certificates["cm-b-tls"]["spec"]["dnsNames"]

        # The brokers linked with the issuer's certificates; a client of the overlay gets in.
        b = cluster.kubelet.procs["cm-b"]
        peers = sorted(n["peer"] for n in (await b.admin.status())["neighbours"])
        assert peers == ["a", "c"]
        creds = cluster.kubelet.credentials("cm")
        sub = await connect(cluster.kubelet.procs["cm-c"].listen, "canopy/s", credentials=creds)
        await sub.subscribe("n >= 0")
        pub = await connect(cluster.kubelet.procs["cm-a"].listen, "canopy/p", credentials=creds)
        await asyncio.sleep(1.0)  # the subscription reaches a
        for n in range(1, 51):
            await pub.publish({"n": n})
        got = []
        async with asyncio.timeout(10):
            while len(got) < 50:
                got += await sub.receive(100)
        assert [x.seq for x in got] == list(range(1, 51))
        for client in (pub, sub):
            await client.close()

        # c removed: its pod, its Certificate and its Secret go.
        spec = overlay_manifest("cm", ["a", "b"], [("a", "b")])["spec"]
        spec["security"] = {"issuerRef": ISSUER}
        await cluster.api.patch(overlay_path(NS, "cm"), {"spec": spec})
        await cluster.ready("cm", generation=2, within=60)
        names = {c["metadata"]["name"] for c in objects(cluster.emulator, "certificates")}
        assert names == {"cm-a-tls", "cm-b-tls", "cm-client"}
        secret_names = {x["metadata"]["name"] for x in objects(cluster.emulator, "secrets")}
        assert "cm-c-tls" not in secret_names

    # Least privilege: the Certificates verbs granted are the ones used.
    used, granted = verbs_used(cluster.emulator), verbs_granted()
    assert used <= granted
    mine = {v for v in granted if v[1] == "certificates"}
    assert mine and {v for v in used if v[1] == "certificates"} == mine


def test_issuer_refs_are_checked_by_name() -> None:
    ok = security_of("o", {"security": {"issuerRef": {"name": "x"}}})
    assert ok.issuer is not None and (ok.issuer.kind, ok.issuer.group) == (
        "Issuer",
        "cert-manager.io",
    )
    for bad, says in (
        ({"issuerRef": "x"}, "must be a mapping"),
        ({"issuerRef": {"kind": "Issuer"}}, ".name must name"),
        ({"issuerRef": {"name": "x", "kind": "Vault"}}, "Issuer or ClusterIssuer"),
        ({"issuerRef": {"name": "x", "nmae": "y"}}, "unknown keys ['nmae']"),
        ({"issuerRef": {"name": "x"}, "tls": False}, "needs TLS"),
    ):
        with pytest.raises(SpecError) as err:
            security_of("o", {"security": bad})
        assert says in str(err.value), (bad, err.value)
