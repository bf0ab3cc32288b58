"""``canopy-broker serve`` argument handling (the process itself is run by the integration
tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
