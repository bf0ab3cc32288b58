"""Spec parsing and validation: every problem is named; valid specs pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.cli import build_parser as broker_parser
from canopy_operator.backends.local import (
    BrokerDownError,
    LocalBackend,
    NotOneTreeError,
    StateFileError,
)
from canopy_operator.backends.manifests import name_problems, service_name
from canopy_operator.model.topology import (
    FIELDS,
    SpecError,
    find_cycle,
    parse_overlay,
    tree_problem,
    validate,
)
from tests.strategies import json_values


def manifest(
    brokers: list[str], links: list[list[str]] | None, **spec: object
) -> dict[str, object]:
    body: dict[str, object] = {"brokers": [{"name": b} for b in brokers], **spec}
    if links is not None:
        body["links"] = links
    return {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "o"},
        "spec": body,
    }


def problems(brokers: list[str], links: list[list[str]] | None, **spec: object) -> list[str]:
    return validate(parse_overlay(manifest(brokers, links, **spec)))


def test_a_valid_tree_and_managed_links_pass() -> None:
    assert problems(["a", "b", "c"], [["a", "b"], ["b", "c"]]) == []
    assert problems(["a", "b", "c"], None) == []


@pytest.mark.parametrize(
    ("brokers", "links", "spec", "message"),
    [
        (["a", "a"], [], {}, "broker name 'a' is declared more than once"),
        (["a", "b"], [["a", "x"]], {}, "link a-x names undeclared broker(s) x"),
        (["a", "b"], [["a", "a"]], {}, "link a-a links a broker to itself"),
        (["a", "b"], [["a", "b"], ["b", "a"]], {}, "link b-a is declared more than once"),
        (["a", "b", "c", "d"], [["a", "b"], ["c", "d"]], {}, "separate parts are a, b; c, d"),
        (["a", "b", "c"], [["a", "b"], ["b", "c"], ["c", "a"]], {}, "contain a cycle"),
        (
            ["h", "a", "b", "c"],
            [["h", "a"], ["h", "b"], ["h", "c"]],
            {"maxFanOut": 2},
            "broker h has 3 links, more than maxFanOut 2",
        ),
        (["Bad_Name"], [], {}, "is not a DNS label"),
        (["a"], [], {"routing": "fancy"}, "routing must be one of simple, identity, covering"),
        (
            ["a"],
            [],
            {"reconfiguration": {"algorithm": "path"}},
            "'path' needs routing 'identity' or 'simple'",
        ),
        ([], [], {}, "spec.brokers is empty"),
        (["a"], [], {"telemetry": {"sample": 1.5}}, "telemetry.sample must be between 0 and 1"),
        (["a"], [], {"telemetry": {"history": -1}}, "telemetry.history must not be negative"),
        (
            ["a"],
            [],
            {"failureDetection": {"retentionSeconds": -1}},
            "retentionSeconds must be between 0 and 3600 (0: custody off), got -1",
        ),
        (["a"], [], {"clients": {"queueLimit": 5}}, "clients.queueLimit must be at least 100"),
        (
            ["a"],
            [],
            {"clients": {"writeIntervalMs": 250}},
            "clients.writeIntervalMs must be between 0 and 100 (0: every loop turn), got 250",
        ),
        (
            ["a"],
            [],
            {"clients": {"slowConsumer": "ignore"}},
            "clients.slowConsumer must be one of disconnect, backpressure",
        ),
        (["a"], [], {"broker": {"logFormat": "xml"}}, "broker.logFormat must be one of text, json"),
    ],
)
def test_problems_name_what_is_wrong(
    brokers: list[str], links: list[list[str]], spec: dict[str, object], message: str
) -> None:
    found = problems(brokers, links, **spec)
    assert any(message in p for p in found), found


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"kind": "Pod"}, "kind must be BrokerOverlay"),
        ({"kind": "BrokerOverlay", "metadata": {}}, "metadata.name is required"),
        ({"kind": "BrokerOverlay", "metadata": {"name": "o"}}, "spec is required"),
        (
            {
                "kind": "BrokerOverlay",
                "metadata": {"name": "o"},
                "spec": {"brokers": [{"zone": "z"}]},
            },
            "spec.brokers[0].name is required",
        ),
        (
            {
                "kind": "BrokerOverlay",
                "metadata": {"name": "o"},
                "spec": {"brokers": [{"name": "a"}], "links": [["a"]]},
            },
            "spec.links[0] must be a pair of broker names",
        ),
        (
            {
                "kind": "BrokerOverlay",
                "metadata": {"name": "o"},
                "spec": {"brokers": [], "maxFanOut": "four"},
            },
            "spec.maxFanOut must be a int",
        ),
    ],
)
def test_malformed_manifests_raise_with_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_overlay(doc)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"maxFanout": 2},
            "spec.maxFanout is not a field of a BrokerOverlay (did you mean 'maxFanOut'?)",
        ),
        ({"linkz": []}, "spec.linkz is not a field of a BrokerOverlay (did you mean 'links'?)"),
        ({"brokers": [{"name": "a", "zon": "x"}]}, "spec.brokers[0].zon is not a field"),
        ({"failureDetection": {"heartbeat": 1}}, "did you mean 'heartbeatSeconds'?"),
        ({"security": {"issuerRef": {"nam": "ca"}}}, "spec.security.issuerRef.nam is not a field"),
    ],
)
def test_a_misspelt_field_is_refused_with_the_one_it_likely_means(
    spec: dict[str, object], message: str
) -> None:
    """``kubectl apply`` refuses a field the CRD does not declare; read from a file by the local
    commands, a misspelt one was taken for its default without a word (``maxFanout: 2``), and
    ``linkz`` made the links managed ones."""
    doc = manifest(["a"], [])
    doc["spec"] = {**doc["spec"], **spec}  # type: ignore[dict-item]
    with pytest.raises(SpecError) as caught:
        parse_overlay(doc)
    assert message in str(caught.value)


def test_the_fields_checked_are_the_crds() -> None:
    """:data:`FIELDS` holds what the CRD's schema declares, no more and no less (a free-form
    part of the schema, or one without properties, is not looked into)."""

    def tree(node: dict[str, object]) -> object:
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            inner = tree(node["items"])  # type: ignore[arg-type]
            return [inner] if inner is not None else None
        props = node.get("properties")
        if not isinstance(props, dict) or node.get("x-kubernetes-preserve-unknown-fields"):
            return None
        return {k: tree(v) for k, v in props.items()}

    crd = yaml.safe_load(
        (Path(__file__).parents[2] / "manifests/crds/brokeroverlays.canopy.dev.yaml").read_text()
    )
    schema = tree(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert isinstance(schema, dict)
    assert FIELDS["spec"] == schema["spec"]
    assert set(FIELDS) == {"apiVersion", "kind", "metadata", *schema}


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", "Trading", "x" * 64, "-a"])
def test_an_overlay_name_that_is_not_a_dns_label_is_refused(name: str) -> None:
    """It names the local overlay's directory and its Kubernetes objects: ``../../etc`` put a
    local overlay's state, credentials and logs two directories up."""
    doc = manifest(["a"], [])
    doc["metadata"] = {"name": name}
    with pytest.raises(SpecError, match="is not a DNS label"):
        parse_overlay(doc)


@pytest.mark.parametrize(
    ("name", "brokers", "problem"),
    [
        ("1net", ["a"], "must begin with a letter"),
        ("n" * 56, ["a"], "has 56 characters, at most 55"),
        ("n" * 55, ["b" * 8], "its pod's host name"),  # 55 + 1 + 8 = 64
    ],
)
def test_names_whose_kubernetes_objects_the_api_server_would_refuse_are_refused(
    name: str, brokers: list[str], problem: str
) -> None:
    """The overlay's Service (NAME-brokers) is a DNS-1035 label and each pod's host name
    (NAME-BROKER) a DNS label: the API server refused them after the operator had made the
    rest. The operator refuses them up front, each naming the object; a local overlay, which
    has neither, takes them (one made under such a name runs on)."""
    doc = manifest(brokers, [])
    doc["metadata"] = {"name": name}
    spec = parse_overlay(doc)
    assert not validate(spec)  # locally fine
    assert any(problem in p for p in name_problems(spec)), name_problems(spec)
    assert len(service_name("n" * 55)) == 63
    ok = manifest(["b" * 7], [])
    ok["metadata"] = {"name": "n" * 55}
    assert not name_problems(parse_overlay(ok))  # 55 + 1 + 7 = 63: fits


def test_telemetry_settings_reach_the_broker_command_line() -> None:
    default = parse_overlay(manifest(["a"], []))
    assert (default.telemetry_sample, default.telemetry_history) == (0.1, 10_000)  # the CRD's
    spec = parse_overlay(manifest(["a"], [], telemetry={"sample": 1, "history": 500}))
    args = broker_parser().parse_args(["serve", "--name", "a", *spec.broker_args()])
    assert (args.telemetry_sample, args.history) == (1.0, 500)
    with pytest.raises(SpecError, match=r"spec\.telemetry\.sample must be a number"):
        parse_overlay(manifest(["a"], [], telemetry={"sample": "lots"}))


def test_custody_and_client_limits_reach_the_broker_command_line() -> None:
    default = broker_parser().parse_args(
        ["serve", "--name", "a", *parse_overlay(manifest(["a"], [])).broker_args()]
    )
    assert (default.standby, default.retention, default.slow_consumer) == (
        True,
        15.0,
        "disconnect",
    )
    spec = parse_overlay(
        manifest(
            ["a"],
            [],
            failureDetection={
                "standbyLinks": False,
                "retentionSeconds": 5,
                "retentionLimit": 9,
                "cycleBound": 6,
                "cyclePeriodSeconds": 0.5,
            },
            clients={
                "slowConsumer": "backpressure",
                "queueLimit": 1000,
                "maxSubscriptions": 7,
                "maxConnectionsPerSource": 3,
                "writeIntervalMs": 2.5,
            },
            broker={"logFormat": "json"},
        )
    )
    args = broker_parser().parse_args(["serve", "--name", "a", *spec.broker_args()])
    assert (args.standby, args.retention, args.retention_limit) == (False, 5.0, 9)
    assert (args.cycle_bound, args.cycle_period) == (6, 0.5)
    assert (default.cycle_bound, default.cycle_period) == (4, 2.0)
    assert (args.slow_consumer, args.client_queue_limit) == ("backpressure", 1000)
    assert (args.max_subscriptions, args.max_connections_per_source) == (7, 3)
    assert (args.client_write_interval_ms, default.client_write_interval_ms) == (2.5, 0.0)
    assert (args.log_format, args.overlay) == ("json", spec.name)


def test_cycle_settings_out_of_range_are_named() -> None:
    spec = parse_overlay(
        manifest(["a"], [], failureDetection={"cycleBound": 40, "cyclePeriodSeconds": -1})
    )
    problems = " ".join(validate(spec))
    assert "failureDetection.cycleBound must be between 0" in problems
    assert "failureDetection.cyclePeriodSeconds must be between 0" in problems
    with pytest.raises(SpecError, match="cyclePeriodSeconds must be a number"):
        parse_overlay(manifest(["a"], [], failureDetection={"cyclePeriodSeconds": "often"}))
    with pytest.raises(SpecError, match=r"clients\.writeIntervalMs is out of range"):
        parse_overlay(manifest(["a"], [], clients={"writeIntervalMs": 10**400}))


def test_the_exchange_lease_is_read_and_must_outlast_failure_detection() -> None:
    """A paused broker must be declared dead (and fenced) before any exchange lease gives up
    on it; otherwise it wakes and finishes a lock try for part of the cycle only."""
    default = parse_overlay(manifest(["a"], []))
    assert default.lease_seconds == 30.0 and validate(default) == []
    spec = parse_overlay(manifest(["a"], [], reconfiguration={"leaseSeconds": 12}))
    assert spec.lease_seconds == 12.0 and validate(spec) == []
    short = parse_overlay(
        manifest(
            ["a"],
            [],
            reconfiguration={"leaseSeconds": 5},
            failureDetection={"heartbeatSeconds": 2, "deadAfter": 3},
        )
    )
    problems = " ".join(validate(short))
    assert "leaseSeconds (5) must exceed the failure detection time" in problems, problems
    assert "(6 s)" in problems
    with pytest.raises(SpecError, match="leaseSeconds must be a number"):
        parse_overlay(manifest(["a"], [], reconfiguration={"leaseSeconds": True}))


def test_find_cycle_names_the_cycle() -> None:
    assert set(find_cycle([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])) == {"a", "b", "c"}
    assert find_cycle([("a", "b"), ("b", "c")]) == []


_FIELDS = ["brokers", "links", "maxFanOut", "routing", "reconfiguration", "selfOrganization"]
_FIELDS += ["telemetry", "failureDetection", "clients", "name", "zone", "mode", "sample"]


@given(
    spec=st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6),
    brokers=st.lists(json_values | st.fixed_dictionaries({"name": json_values}), max_size=4),
)
@settings(max_examples=150)
def test_any_manifest_is_parsed_or_refused_by_name(
    spec: dict[str, object], brokers: list[object]
) -> None:
    """Fuzz: whatever a manifest holds, parsing either refuses it with a SpecError naming a
    field, or gives a spec whose validation lists problems as text; nothing else escapes."""
    doc = {"kind": "BrokerOverlay", "metadata": {"name": "o"}, "spec": {"brokers": brokers, **spec}}
    try:
        parsed = parse_overlay(doc)
    except SpecError as exc:
        assert "spec" in str(exc) or "must" in str(exc), exc
        return
    assert all(isinstance(p, str) and p for p in validate(parsed))


def test_tree_problem_says_what_is_wrong_and_nothing_for_a_tree() -> None:
    nodes = ["a", "b", "c", "d"]
    assert tree_problem(nodes, [("a", "b"), ("c", "b"), ("c", "d")]) is None
    assert tree_problem(nodes, [("a", "b"), ("b", "c")]) == "d linked to nobody (parts: a, b, c; d)"
    assert tree_problem(nodes, [("a", "b"), ("c", "d")]) == "split in 2 parts: a, b; c, d"
    cycle = tree_problem(nodes, [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])
    assert cycle is not None and cycle.startswith("a cycle: "), cycle
    assert set(cycle.removeprefix("a cycle: ").split(" - ")) == {"a", "b", "c"}
    assert tree_problem(["a"], [("a", "x")]) == "links to brokers it does not run: x"
    assert tree_problem(["a"], []) is None
    assert tree_problem([], []) is None  # a new overlay: nothing runs yet


async def test_apply_waits_for_a_whole_overlay_and_says_why_when_it_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`canopy apply` between a death and its repair (`canopy bench chaos --seed 37`, a
    restored broker not yet linked) planned from links that were not one tree, and failed
    with the planner's traceback. It waits for the overlay to be whole, then says what is
    wrong."""
    backend = LocalBackend(tmp_path / "o", insecure=True)
    backend.state["brokers"] = {b: {"pid": 1} for b in ("b0", "b1", "b2")}
    views = [[("b0", "b1")], [("b0", "b1")], [("b0", "b1"), ("b1", "b2")]]

    async def live_links() -> list[tuple[str, str]]:
        return views.pop(0) if len(views) > 1 else views[0]

    monkeypatch.setattr(backend, "live_links", live_links)
    assert await backend.live_tree(within=5.0) == [("b0", "b1"), ("b1", "b2")]
    assert views == [[("b0", "b1"), ("b1", "b2")]]  # it asked again until the tree was whole

    views[:] = [[("b0", "b1")]]
    with pytest.raises(NotOneTreeError, match=r"not one tree after 0.3s: b2 linked to nobody"):
        await backend.live_tree(within=0.3)
    assert issubclass(NotOneTreeError, BrokerDownError)  # the CLI prints it as an error


def test_the_local_state_is_private_and_its_token_is_the_pki_one(tmp_path: Path) -> None:
    """``state.json`` holds the admin token the brokers run with: it was world-readable
    (0644 in a 0755 directory), and any local user could drive every broker's admin API. And
    the token in ``pki/admin-token``, which the docs name, was not the one in use."""
    backend = LocalBackend(tmp_path / "o")
    backend.save()
    assert (tmp_path / "o").stat().st_mode & 0o777 == 0o700
    assert backend.state_file.stat().st_mode & 0o777 == 0o600
    assert backend.pki is not None and backend.state["token"] == backend.pki.admin_token()
    (tmp_path / "o").chmod(0o755)  # an overlay made before: mended on its next command
    backend.state_file.chmod(0o644)
    again = LocalBackend(tmp_path / "o")
    again.save()
    assert (tmp_path / "o").stat().st_mode & 0o777 == 0o700
    assert again.state_file.stat().st_mode & 0o777 == 0o600


def test_a_state_file_gone_bad_is_named_and_the_supervisor_keeps_what_it_read(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(tmp_path / "o", insecure=True)
    backend.state["generation"] = 7
    backend.save()
    backend.state_file.write_text('{"brok')
    backend.reload()  # the supervisor's: a warning, and the state it had
    assert backend.state["generation"] == 7
    with pytest.raises(StateFileError, match=r"state.json is not valid JSON"):
        LocalBackend(tmp_path / "o")
    backend.state_file.write_text("[1, 2]")
    with pytest.raises(StateFileError, match="not an overlay's state"):
        LocalBackend(tmp_path / "o")
