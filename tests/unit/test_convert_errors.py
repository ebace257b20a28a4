"""``convert``'s errors name a file once: the field is the file, the problem does not repeat it."""

from __future__ import annotations

from liveshard.dev.cli import run_cli


def test_a_broken_config_json_is_named_once(tmp_path):
    (tmp_path / "config.json").write_text("{bad")
    r = run_cli("convert", "--from", f"hf:{tmp_path}", "--print-model")
    path = str(tmp_path / "config.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.count(path) == 1 and f"{path}: is not valid JSON" in r.stderr, r.stderr
