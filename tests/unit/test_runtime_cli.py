"""``canopy-broker serve`` argument handling (the process itself is run by the integration
tests)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from canopy_broker import cli
from canopy_broker.cli import TOKEN_ENV, build_parser, resolve_token


def test_refuses_to_start_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    args = build_parser().parse_args(["serve", "--name", "b"])
    with pytest.raises(SystemExit) as info:
        resolve_token(args)
    assert "no admin token" in str(info.value)


def test_token_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    parse = build_parser().parse_args
    assert resolve_token(parse(["serve", "--name", "b", "--token", "t1"])) == "t1"
    f = tmp_path / "tok"
    f.write_text("t2\n")
    assert resolve_token(parse(["serve", "--name", "b", "--token-file", str(f)])) == "t2"
    monkeypatch.setenv(TOKEN_ENV, "t3")
    assert resolve_token(parse(["serve", "--name", "b"])) == "t3"
    monkeypatch.delenv(TOKEN_ENV)
    assert resolve_token(parse(["serve", "--name", "b", "--insecure-no-token"])) is None


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve", "--name", "b", "--routing", "identity"])
    assert (args.listen, args.admin, args.routing, args.history) == (
        "127.0.0.1:7400",
        "127.0.0.1:7401",
        "identity",
        10_000,
    )


def test_write_pacing_takes_milliseconds_from_0_to_100(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--name", "b"]).client_write_interval_ms == 0.0
    assert (
        parse(
            ["serve", "--name", "b", "--client-write-interval-ms", "2.5"]
        ).client_write_interval_ms
        == 2.5
    )
    for bad, why in [
        ("-1", "between 0 and 100"),
        ("101", "between 0 and 100"),
        ("nan", "between 0 and 100"),
        ("2ms", "not a number of milliseconds"),
    ]:
        with pytest.raises(SystemExit):
            parse(["serve", "--name", "b", "--client-write-interval-ms", bad])
        err = capsys.readouterr().err
        assert "--client-write-interval-ms" in err and why in err, err


_TLS_READS = """
import ctypes, resource, sys
# A fresh interpreter without site (nothing else allocated much yet), in a broker's state:
# glibc's default threshold, held, and no free room at the heap's top (which would serve the
# buffers whatever the threshold).
libc = ctypes.CDLL(None)
libc.mallopt(-3, 128 * 1024)
settings = [int(x) for x in sys.argv[1:]]
for param, value in zip(settings[::2], settings[1::2]):
    assert libc.mallopt(param, value) == 1
libc.malloc_trim(0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def read():  # what each TLS read does: 256 KiB asked for, shrunk to what came, freed
    b = bytearray(262144)
    del b[2000:]
for _ in range(20):
    read()
f0 = faults()
for _ in range(200):
    read()
print(faults() - f0)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_allocator_settings_reuse_the_tls_read_buffers_instead_of_mapping_each() -> None:
    """glibc maps each 256 KiB read buffer afresh (tens of page faults per read); with the
    thresholds tune_allocator sets, the heap serves them with none."""

    def faults(*settings: int) -> int:
        done = subprocess.run(
            [sys.executable, "-S", "-c", _TLS_READS, *map(str, settings)],
            env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return int(done.stdout)

    assert faults() > 200 * 10
    tuned = (cli._M_MMAP_THRESHOLD, cli.MMAP_THRESHOLD, cli._M_TRIM_THRESHOLD, cli.TRIM_THRESHOLD)
    assert faults(*tuned) < 50


class _Mallopt:
    """A stand-in for libc's mallopt: records its calls (and takes ctypes' signature)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.argtypes: object = None
        self.restype: object = None

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


class _Libc:
    def __init__(self) -> None:
        self.mallopt = _Mallopt()
        self.calls = self.mallopt.calls


def test_tune_allocator_sets_both_thresholds_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libc = _Libc()
    monkeypatch.setattr(cli.ctypes, "CDLL", lambda _name: libc)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert cli.tune_allocator()
    assert libc.calls == [
        (cli._M_MMAP_THRESHOLD, cli.MMAP_THRESHOLD),
        (cli._M_TRIM_THRESHOLD, cli.TRIM_THRESHOLD),
    ]
    assert cli.MMAP_THRESHOLD > 256 * 1024 and cli.TRIM_THRESHOLD > cli.MMAP_THRESHOLD
    libc.calls.clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # the operator's choice stands
    assert not cli.tune_allocator() and libc.calls == []
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("", ""))  # musl, macOS: no-op
    assert not cli.tune_allocator() and libc.calls == []


@pytest.mark.parametrize(
    ("limits", "asked", "ends_at"),
    [
        ((1024, 4096), (4096, 4096), 4096),  # up to the hard limit
        ((1024, -1), (cli.FILES_WANTED, -1), cli.FILES_WANTED),  # unlimited (macOS): a cap
        ((65536, 65536), None, 65536),  # already there: nothing asked
    ],
)
def test_the_broker_raises_its_open_files_limit(
    monkeypatch: pytest.MonkeyPatch,
    limits: tuple[int, int],
    asked: tuple[int, int] | None,
    ends_at: int,
) -> None:
    """A shell's 1,024 ran out under a flood before the broker's own bounds applied."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(cli.resource, "RLIM_INFINITY", -1)
    monkeypatch.setattr(cli.resource, "getrlimit", lambda what: limits)
    monkeypatch.setattr(cli.resource, "setrlimit", lambda what, lim: calls.append(lim))
    assert cli.raise_file_limit() == ends_at
    assert calls == ([asked] if asked else [])
