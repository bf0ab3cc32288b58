"""POST /reconfigurations and GET /reconfigurations/{id} on real broker processes: the three
kinds, idempotency by id, message counts, and clear errors."""

from __future__ import annotations

import pytest

from canopy_broker.admin_client import AdminError
from canopy_broker.core.messages import RoutingMode
from canopy_broker.procs import Overlay, spawn_broker
from canopy_broker.sim.checker import canonical_tables

pytestmark = pytest.mark.integration


async def test_leaf_and_exchange_through_one_endpoint() -> None:
    async with Overlay(["a", "b", "c"], [("a", "b"), ("b", "c")]) as ov:
        d = await spawn_broker("d", token=ov.token, log_dir=ov.log_dir)
        ov.brokers["d"] = d
        step = await d.admin.reconfigure(
            "add-d", "add-leaf", peer="c", address=ov["c"].link_address
        )
        assert step["state"] == "finished"
        assert await d.admin.reconfigure("add-d", "add-leaf", peer="c", address="x") == step
        book = {n: p.link_address for n, p in ov.brokers.items()}
        for p in ov.brokers.values():
            await p.admin.set_peers(book)
        # Exchange b-c for a-c (cycle a-b-c), idempotent by id, with message counts.
        rec = await ov["a"].admin.reconfigure(
            "x1", "exchange", path=["a", "b", "c"], remove=["b", "c"], wait=20
        )
        assert rec["state"] == "finished" and rec["ok"] is True
        again = await ov["a"].admin.reconfigure(
            "x1", "exchange", path=["a", "b", "c"], remove=["b", "c"], wait=1
        )
        assert again["started"] == rec["started"]
        got = await ov["a"].admin.reconfiguration("x1")
        assert got["messages_sent_here"].get("Lock") == 1
        assert "Done" in got["messages_sent_here"]
        # Remove leaf d (no clients: drained at once).
        gone = await d.admin.reconfigure("rm-d", "remove-leaf", target="c", wait=20)
        assert gone["state"] == "finished"
        await ov.settle()
        expected = canonical_tables([("a", "b"), ("a", "c")], {}, RoutingMode.COVERING)
        for n in ("a", "b", "c"):
            table = (await ov[n].admin.routing())["table"]
            assert sorted(table["links"]) == sorted(expected[n])  # the neighbours of the tree


async def test_bad_requests_are_refused_by_name() -> None:
    async with Overlay(["a", "b"], [("a", "b")]) as ov:
        with pytest.raises(AdminError, match="'kind' is exchange, add-leaf or remove-leaf"):
            await ov["a"].admin.reconfigure("r", "teleport")
        with pytest.raises(AdminError, match="need 'id'"):
            await ov["a"].admin.reconfigure("", "exchange")
        with pytest.raises(AdminError, match="no reconfiguration nope here"):
            await ov["a"].admin.reconfiguration("nope")
