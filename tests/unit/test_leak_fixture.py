"""The task-leak check itself can fail (negative control for the conftest fixture)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def test_leaking_test_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(
        """
        import asyncio

        async def test_leaks():
            asyncio.get_running_loop().create_task(asyncio.sleep(30))
        """
    )
    result = pytester.runpytest(
        "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function"
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*leaked 1 asyncio task*"])


async def test_a_clean_async_test_passes() -> None:
    await asyncio.sleep(0)
