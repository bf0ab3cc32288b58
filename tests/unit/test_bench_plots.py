"""The benchmarks' pictures (``--plot``): each draws the figures of the result it is given, no
other, into a file of the type asked, with each goal over the figures it is about; a target
that cannot be drawn is refused by name before anything runs. What a picture holds is read back
from the figure itself (its lines, bars and their bases, dots, goal marks and tick labels), so
a wrong value, base, goal or label fails here. The results have the shape the benchmarks
return (tests/cli runs the real ones with ``--plot``)."""

from __future__ import annotations

import math
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
    """Every percentile at every rate; the latency goal over the chain's rates alone; each
    throughput bar under its own name with the table's target over it alone."""
    out = tmp_path / "dataplane.png"
    latency, throughput = bench_plots.dataplane(dataplane_result(), str(out))
    assert out.read_bytes().startswith(PNG)
    lines = latency["lines"]
    assert lines["chain of 3 p99"] == [(6000, 4.1), (12000, 10.6)]
    assert lines["1 broker p99.9"] == [(8000, 3.1), (16000, 7.2)]
    assert lines["chain of 3 p50"] == [(6000, 2.0), (12000, 3.4)]
    assert len(lines) == 6
    [goal] = latency["goals"].values()
    assert goal == [(6000, 12000, 5.0)]
    [bars] = throughput["bars"].values()
    assert [(x, h) for x, h, _ in bars] == [(0, 610_000), (1, 640_000), (2, 250_000)]
    names = [t.split("\n")[0] for t in throughput["xticks"]]
    assert names == ["1 broker", "1 broker", "chain of 3"]
    assert "per broker CPU-s" in throughput["xticks"][1]
    marks = [m for ms in throughput["goals"].values() for m in ms]
    assert sorted((round(a + b) // 2, y) for a, b, y in marks) == [
        (0, 100_000), (1, 500_000), (2, 50_000)
    ]  # fmt: skip


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
    [panel] = bench_plots.peers(result, ratios, "a workload", str(out))
    assert "<svg" in out.read_text()
    bars = panel["bars"]
    assert bars["user (the broker's code)"] == [(0, 3.0, 0), (1, 2.1, 0), (2, 1.0, 0)]
    # The kernel's part stacked on each system's own: the bar's top is the median round.
    assert bars["system (the kernel, for it)"] == [(0, 3.5, 3.0), (1, 4.8, 2.1), (2, 4.5, 1.0)]
    assert panel["dots"]["canopy rounds"] == [(0, 6.5), (0, 5.5), (0, 7.5)]
    assert [y for _, y in panel["dots"]["mosquitto rounds"]] == [5.5, 5.1, 5.8]
    [goal] = panel["goals"].values()
    assert [y for _, _, y in goal] == [pytest.approx(1.5 * 6.9)]  # NATS's median round
    ticks = [t.split("\n") for t in panel["xticks"]]
    assert [t[0] for t in ticks] == ["canopy", "nats", "mosquitto"]
    to_nats, to_mosquitto = ratios["canopy"]
    assert ticks[0][1:] == [f"{to_nats:.2f}x NATS", f"{to_mosquitto:.2f}x Mosquitto"]
    # Latency and pacing, when the result has them, under the name.
    paced = {**result["canopy"], "p50_ms": 1.41, "p99_ms": 3.12, "client_write_interval_ms": 2.0}
    [panel] = bench_plots.peers({"canopy": paced}, {"canopy": (math.nan, 0.9)}, "w", str(out))
    assert panel["xticks"] == ["canopy, paced 2 ms\n0.90x Mosquitto\np50 1.4 / p99 3.1 ms"]


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
    cost, took, stalls = bench_plots.subscriptions(result, str(out))
    assert out.read_bytes().startswith(PNG)
    # Only an install of ten batches or more has tenths to draw.
    assert list(cost["lines"]) == ["N = 100,000"]
    assert cost["lines"]["N = 100,000"] == list(zip(range(10, 101, 10), tenths, strict=True))
    assert took["xticks"] == ["1,000", "100,000"]
    assert [h for _, h, _ in took["bars"]["in every table"]] == [1000 / 5500, 100_000 / 5500]
    assert [h for _, h, _ in took["bars"]["acknowledged"]] == [1000 / 6000, 100_000 / 6000]
    # The 30 s goal is about 100k: over that install's bars alone.
    [goal] = took["goals"].values()
    assert [(round(a + b) // 2, y) for a, b, y in goal] == [(1, 30.0)]
    assert [t.split("\n")[-1] for t in stalls["xticks"]] == ["1,000", "100,000", "churn", "leave"]
    walls = [h for _, h, _ in stalls["bars"]["longest stall"]]
    assert walls == pytest.approx([4.0, 21.0, 12.0, 30.0])
    cpus = [h for _, h, _ in stalls["bars"]["of it on CPU"]]
    assert cpus == pytest.approx([2.0, 10.5, 11.0, 9.0])
    assert [y for _, _, y in next(iter(stalls["goals"].values()))] == [50.0]


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
    capacity, memory = bench_plots.broker_scale(points, "a workload", str(out))
    assert out.read_bytes().startswith(b"%PDF")
    assert capacity["lines"]["notifications per broker CPU-second"] == [
        (1000, 650_000), (10_000, 600_000), (100_000, 420_000)
    ]  # fmt: skip
    assert not capacity["goals"]  # the 500,000/s goal is bench dataplane's load, not this one
    assert capacity["xticks"] == memory["xticks"] == ["1,000", "10,000", "100,000"]
    assert [y for _, y in memory["lines"]["RSS holding the filters"]] == [43.0, 60.0, 241.0]
    assert [y for _, y in memory["lines"]["RSS before"]] == [40.0, 40.0, 40.0]


def test_a_target_that_cannot_be_drawn_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_plots.check_target(str(tmp_path / "ok.png")) is None
    assert not bench_plots.refused(None)  # no --plot: nothing to check
    why = bench_plots.check_target(str(tmp_path / "figures.txt"))
    assert why is not None and "must end in .png, .svg, .pdf" in why
    why = bench_plots.check_target(str(tmp_path / "nowhere" / "x.png"))
    assert why is not None and "there is no directory" in why and "nowhere" in why
    (tmp_path / "a.png").mkdir()
    why = bench_plots.check_target(str(tmp_path / "a.png"))
    assert why is not None and "is a directory" in why
    why = bench_plots.check_target("/proc/canopy.png")  # no file can be made there
    assert why is not None and "cannot write it" in why
    assert not list(tmp_path.glob("ok.png"))  # the check leaves no file behind
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    why = bench_plots.check_target(str(tmp_path / "ok.png"))
    assert why is not None and "needs matplotlib" in why and "canopy[report]" in why
    assert bench_plots.refused(str(tmp_path / "ok.png"))
    assert "error: --plot needs matplotlib" in capsys.readouterr().err


def test_a_picture_that_fails_after_the_run_says_so_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The figures are printed before the picture is drawn: if it still fails (the directory
    went away meanwhile), the command says why and exits 1, with nothing else lost."""
    assert bench_plots.draw(None, lambda _: 1 / 0) == 0  # no --plot: nothing drawn
    gone = tmp_path / "gone" / "x.png"
    assert bench_plots.draw(str(gone), lambda p: bench_plots.dataplane(dataplane_result(), p)) == 1
    assert f"error: --plot {gone}: the picture could not be drawn" in capsys.readouterr().err
    out = tmp_path / "x.png"
    assert bench_plots.draw(str(out), lambda p: bench_plots.dataplane(dataplane_result(), p)) == 0
    assert f"drew {out}" in capsys.readouterr().err
