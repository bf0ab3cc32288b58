"""The install's CPU by tenth (``canopy bench subscriptions``): its arithmetic."""

from __future__ import annotations

import pytest

from canopy_broker.bench_subscriptions import _tenths


def test_tenths_split_the_batches_and_count_a_short_last_batch_as_short() -> None:
    # 10 brokers, 20 batches of 100 (the last one 50): 1,950 subscriptions. The brokers spend
    # 1 ms per batch in the first half and 2 ms in the second, 1 ms in the short last one.
    spent = [0.001] * 10 + [0.002] * 9 + [0.001]
    cpu = [5.0]
    for s in spent:
        cpu.append(cpu[-1] + s)
    tenths = _tenths(cpu, 1950, 100, 10)
    assert len(tenths) == 10
    # 2 batches per tenth: 2 ms over 200 subscriptions x 10 brokers = 1 us each, then 2 us;
    # the last tenth: 3 ms over 150 x 10.
    assert tenths[:5] == pytest.approx([1.0] * 5)
    assert tenths[5:9] == pytest.approx([2.0] * 4)
    assert tenths[9] == pytest.approx(2.0)


def test_tenths_need_ten_batches() -> None:
    assert _tenths([0.0] * 10, 900, 100, 4) == []  # nine batches
    assert len(_tenths([0.0] * 11, 1000, 100, 4)) == 10


def test_uneven_batches_are_shared_out_without_gaps() -> None:
    # 13 batches: every batch falls in exactly one tenth, so the tenths' CPU adds up.
    cpu = [float(i * i) for i in range(14)]
    n, batch, brokers = 1300, 100, 2
    tenths = _tenths(cpu, n, batch, brokers)
    bounds = [13 * t // 10 for t in range(11)]
    total = sum(v * (bounds[t + 1] - bounds[t]) * batch * brokers for t, v in enumerate(tenths))
    assert total / 1e6 == pytest.approx(cpu[-1] - cpu[0])
