"""The benchmarks' pictures (``--plot``): each draws the figures of the result it is given, no
other, into a file of the type asked; a target that cannot be drawn is refused by name before
anything runs. The results here have the shape the benchmarks return (tests/cli runs the real
ones with ``--plot``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from canopy_broker import bench_plots
from canopy_broker.bench_peers import paired_ratio, summary

PNG = b"\x89PNG\r\n\x1a\n"


def latency(load: float, rate: int, p50: float, p99: float, p999: float) -> dict[str, Any]:
    return {"load": load, "events_per_s": rate, "p50_ms": p50, "p99_ms": p99, "p999_ms": p999}


def dataplane_result() -> dict[str, Any]:
    single = {
        "notif_per_s": 610_000,
        "notif_per_broker_cpu_s": 640_000,
        "latency": [latency(0.25, 8000, 0.9, 2.5, 3.1), latency(0.5, 16000, 1.4, 4.6, 7.2)],
    }
    chain = {
        "notif_per_s": 250_000,
        "latency": [latency(0.25, 6000, 2.0, 4.1, 7.2), latency(0.5, 12000, 3.4, 10.6, 14.7)],
    }
    return {
        "tls": True,
        "detail": {
            "single": single,
            "chain3": chain,
            "machine": {"round_trip_us": 77.0},
            "filters": 1000,
        },
    }


def test_dataplane_draws_each_percentile_at_each_measured_rate(tmp_path: Path) -> None:
    out = tmp_path / "dataplane.png"
    drawn = bench_plots.dataplane(dataplane_result(), str(out))
    assert out.read_bytes().startswith(PNG)
    assert drawn["chain of 3 p99"] == ([6000, 12000], [4.1, 10.6])
    assert drawn["1 broker p99.9"] == ([8000, 16000], [3.1, 7.2])
    assert drawn["chain of 3 p50"] == ([6000, 12000], [2.0, 3.4])
    assert drawn["notifications/s"][1] == [610_000, 640_000, 250_000]


def peer_round(user: float, system: float) -> dict[str, Any]:
    return {
        "us_per_notification": round(user + system, 3),
        "user_us": user,
        "system_us": system,
        "delivered": 400,
        "expected": 400,
        "notif_per_s": 50_000,
    }


def test_peers_draws_the_median_round_split_and_every_round(tmp_path: Path) -> None:
    """The bars are each system's median round (its own code and the kernel's), the dots every
    round; the ratios under the names are the paired ones the table prints."""
    result = {
        "canopy": summary([peer_round(3.0, 3.5), peer_round(2.5, 3.0), peer_round(3.5, 4.0)]),
        "nats": summary([peer_round(2.0, 5.0), peer_round(2.1, 4.8), peer_round(1.9, 4.4)]),
        "mosquitto": summary([peer_round(1.0, 4.5), peer_round(1.1, 4.0), peer_round(1.2, 4.6)]),
    }
    ratios = {
        n: (paired_ratio(result, n, "nats"), paired_ratio(result, n, "mosquitto")) for n in result
    }
    out = tmp_path / "peers.svg"
    drawn = bench_plots.peers(result, ratios, "a workload", str(out))
    assert "<svg" in out.read_text()
    assert drawn["user (the broker's code)"] == ([0, 1, 2], [3.0, 2.1, 1.0])
    assert drawn["system (the kernel, for it)"] == ([0, 1, 2], [3.5, 4.8, 4.5])
    assert drawn["canopy rounds"] == ([0.0] * 3, [6.5, 5.5, 7.5])
    assert drawn["mosquitto rounds"][1] == [5.5, 5.1, 5.8]


def install(n: int, tenths: list[float] | None, stall: float) -> dict[str, Any]:
    r: dict[str, Any] = {
        "subscriptions": n,
        "acknowledged_s": n / 6000,
        "installed_everywhere_s": n / 5500,
        "longest_stall_s": stall,
        "longest_stall_cpu_s": stall / 2,
    }
    if tenths is not None:
        r["cpu_us_per_insert_by_tenth"] = tenths
    return r


def test_subscriptions_draws_insertion_cost_by_tenth_install_times_and_stalls(
    tmp_path: Path,
) -> None:
    tenths = [31.0, 32.5, 33.0, 32.0, 34.1, 33.3, 35.0, 34.2, 33.9, 34.8]
    result = {
        "brokers": 10,
        "routing": "covering",
        "install": [install(1000, None, 0.004), install(100_000, tenths, 0.021)],
        "churn": {"longest_stall_s": 0.012, "longest_stall_cpu_s": 0.011},
        "leave": {"longest_stall_s": 0.030, "longest_stall_cpu_s": 0.009},
    }
    out = tmp_path / "subscriptions.png"
    drawn = bench_plots.subscriptions(result, str(out))
    assert out.read_bytes().startswith(PNG)
    # Only an install of ten batches or more has tenths to draw.
    assert [k for k in drawn if k.startswith("N = ")] == ["N = 100,000"]
    assert drawn["N = 100,000"] == ([10, 20, 30, 40, 50, 60, 70, 80, 90, 100], tenths)
    assert drawn["in every table"][1] == [1000 / 5500, 100_000 / 5500]
    assert drawn["longest stall"][1] == pytest.approx([4.0, 21.0, 12.0, 30.0])
    assert drawn["of it on CPU"][1] == pytest.approx([2.0, 10.5, 11.0, 9.0])


def test_broker_scale_draws_capacity_and_memory_against_filters(tmp_path: Path) -> None:
    points = [
        {
            "filters": n,
            "capacity_notif_per_s": cap,
            "rss_mb": {"before": 40.0, "filters": rss, "end": rss + 1},
            "bytes_per_filter": round((rss - 40.0) * 2**20 / n),
        }
        for n, cap, rss in (
            (1000, 650_000, 43.0),
            (10_000, 600_000, 60.0),
            (100_000, 420_000, 241.0),
        )
    ]
    out = tmp_path / "broker.pdf"
    drawn = bench_plots.broker_scale(points, "a workload", str(out))
    assert out.read_bytes().startswith(b"%PDF")
    assert drawn["notifications per broker CPU-second"] == (
        [1000, 10_000, 100_000],
        [650_000, 600_000, 420_000],
    )
    assert drawn["RSS holding the filters"][1] == [43.0, 60.0, 241.0]


def test_a_target_that_cannot_be_drawn_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_plots.check_target(str(tmp_path / "ok.png")) is None
    assert not bench_plots.refused(None)  # no --plot: nothing to check
    why = bench_plots.check_target(str(tmp_path / "figures.txt"))
    assert why is not None and "must end in .png, .svg, .pdf" in why
    why = bench_plots.check_target(str(tmp_path / "nowhere" / "x.png"))
    assert why is not None and "there is no directory" in why and "nowhere" in why
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    why = bench_plots.check_target(str(tmp_path / "ok.png"))
    assert why is not None and "needs matplotlib" in why and "canopy[report]" in why
    assert bench_plots.refused(str(tmp_path / "ok.png"))
    assert "error: --plot needs matplotlib" in capsys.readouterr().err
