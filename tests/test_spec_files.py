"""What a workflow spec may read from disk, and how much a spec may hold (docs/design.md §6): `prompt_file`
only from spec files and only for regular files inside the spec's folder, never over HTTP; size
limits for specs from the network; YAML without anchors/aliases for spec and `serve --config` files."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow_ray.cli import main
from kvflow_ray.commands import serve as serve_command
from kvflow_ray.core.graph import (
    MAX_PROMPT_FILE_BYTES,
    MAX_SPEC_FILE_BYTES,
    SpecError,
    SpecLimitError,
    SpecLimits,
    WorkflowSpec,
    load_spec,
    loads_spec,
    parse_spec,
)
from kvflow_ray.core.safe_yaml import MAX_CONFIG_FILE_BYTES, load_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]

# Nine levels of nine-fold aliases: 9**9 (387 million) strings once expanded. yaml.safe_load spends
# tens of seconds (and gigabytes) on it; refused at the first anchor it must take no time at all.
ALIAS_BOMB = "\n".join(
    ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
) + "\n"


def spec_with_prompt_file(prompt_file: str, name: str = "w") -> dict[str, Any]:
    return {"name": name, "agents": {"a": {"prompt_file": prompt_file}, "b": {"after": ["a"]}}}


def spec_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "specs"
    folder.mkdir()
    return folder


def expect_prompt_file_error(data: dict[str, Any], base_dir: Path | None, fragment: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data, base_dir=base_dir)
    assert info.value.field == "agents.a.prompt_file", info.value
    assert fragment in info.value.message, info.value
    assert "prompt_file:" not in info.value.message, f"nested error: {info.value}"
    return info.value


def finishes_within(seconds: float, fn: Callable[[], object], fifo: Path | None = None) -> object:
    """fn()'s result or raised exception; fails (instead of hanging the suite) when it blocks. A reader
    blocked opening ``fifo`` is released by opening the FIFO's other end."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["value"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
            thread.join(5)
        pytest.fail(f"still running after {seconds} s (blocked?)")
    return outcome["value"]


# ---------------------------------------------------------------------------------------------------
# prompt_file from spec files


def test_prompt_file_inside_the_folder_is_read(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (folder / "prompts").mkdir()
    (folder / "prompts" / "a.txt").write_text("You are A. é\n", encoding="utf-8")
    (folder / "w.yaml").write_text("name: w\nagents:\n  a: {prompt_file: prompts/a.txt}\n", encoding="utf-8")
    assert load_spec(folder / "w.yaml").agents["a"].prompt == "You are A. é\n"
    # `..` that stays inside the folder, and a symlink inside the folder to a file inside it, are fine
    assert parse_spec(spec_with_prompt_file("prompts/../prompts/a.txt"), folder).agents["a"].prompt == "You are A. é\n"
    (folder / "link.txt").symlink_to(folder / "prompts" / "a.txt")
    assert parse_spec(spec_with_prompt_file("link.txt"), folder).agents["a"].prompt == "You are A. é\n"


def test_the_repository_workflows_still_load() -> None:
    paths = sorted((REPO_ROOT / "workflows").glob("*.yaml"))
    assert paths
    for path in paths:
        assert isinstance(load_spec(path), WorkflowSpec)
    proc = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "validate", "workflows/peer.yaml"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


def test_absolute_prompt_file_is_refused_even_if_it_exists(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    inside = folder / "a.txt"
    inside.write_text("secret")
    expect_prompt_file_error(spec_with_prompt_file(str(inside)), folder, "relative to the spec's folder")
    expect_prompt_file_error(spec_with_prompt_file("/etc/passwd"), folder, "relative to the spec's folder")


def test_dotdot_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (tmp_path / "outside.txt").write_text("secret")
    err = expect_prompt_file_error(spec_with_prompt_file("../outside.txt"), folder, "outside the spec's folder")
    assert "secret" not in str(err)
    expect_prompt_file_error(spec_with_prompt_file("x/../../outside.txt"), folder, "outside the spec's folder")


def test_symlink_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (tmp_path / "outside.txt").write_text("secret")
    (folder / "link.txt").symlink_to(tmp_path / "outside.txt")
    (folder / "dirlink").symlink_to(tmp_path)
    expect_prompt_file_error(spec_with_prompt_file("link.txt"), folder, "outside the spec's folder")
    expect_prompt_file_error(spec_with_prompt_file("dirlink/outside.txt"), folder, "outside the spec's folder")


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    fifo = folder / "prompt.fifo"
    os.mkfifo(fifo)
    (folder / "fifo-link").symlink_to(fifo)
    for name in ("prompt.fifo", "fifo-link"):
        result = finishes_within(10, lambda n=name: parse_spec(spec_with_prompt_file(n), folder), fifo=fifo)
        assert isinstance(result, SpecError), result
        assert result.field == "agents.a.prompt_file" and "not a regular file" in result.message


def test_directory_and_device_are_refused(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (folder / "sub").mkdir()
    expect_prompt_file_error(spec_with_prompt_file("sub"), folder, "not a regular file")
    expect_prompt_file_error(spec_with_prompt_file("."), folder, "not a regular file")
    expect_prompt_file_error(spec_with_prompt_file(""), folder, "relative to the spec's folder")
    (folder / "zero").symlink_to("/dev/zero")  # outside the folder anyway; and not a regular file
    expect_prompt_file_error(spec_with_prompt_file("zero"), folder, "outside the spec's folder")


def test_oversize_prompt_file_is_refused(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (folder / "max.txt").write_bytes(b"x" * MAX_PROMPT_FILE_BYTES)
    (folder / "big.txt").write_bytes(b"x" * (MAX_PROMPT_FILE_BYTES + 1))
    assert len(parse_spec(spec_with_prompt_file("max.txt"), folder).agents["a"].prompt or "") == MAX_PROMPT_FILE_BYTES
    expect_prompt_file_error(spec_with_prompt_file("big.txt"), folder, f"{MAX_PROMPT_FILE_BYTES}-byte limit")


def test_non_utf8_prompt_file_is_refused(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    (folder / "latin1.txt").write_bytes("café".encode("latin-1"))
    expect_prompt_file_error(spec_with_prompt_file("latin1.txt"), folder, "not UTF-8 text (byte 0xe9 at offset 3)")


def test_missing_broken_and_odd_paths_are_spec_errors(tmp_path: Path) -> None:
    folder = spec_folder(tmp_path)
    expect_prompt_file_error(spec_with_prompt_file("nope.txt"), folder, "No such file")
    (folder / "loop").symlink_to(folder / "loop")
    expect_prompt_file_error(spec_with_prompt_file("loop"), folder, "cannot read")
    expect_prompt_file_error(spec_with_prompt_file("a\x00b"), folder, "cannot read")


# ---------------------------------------------------------------------------------------------------
# prompt_file from the network


def test_network_spec_may_not_use_prompt_file(tmp_path: Path) -> None:
    existing = tmp_path / "secret.txt"
    existing.write_text("secret")
    fifo = tmp_path / "f.fifo"
    os.mkfifo(fifo)
    messages = set()
    for path in (str(existing), str(tmp_path / "missing.txt"), "relative.txt", "../../etc/passwd", str(fifo)):
        result = finishes_within(10, lambda p=path: parse_spec(spec_with_prompt_file(p)), fifo=fifo)
        assert isinstance(result, SpecError), result
        assert result.field == "agents.a.prompt_file"
        assert "not allowed in a spec sent over HTTP" in result.message and "inline" in result.message
        messages.add(str(result))
    assert len(messages) == 1, f"the answer must not depend on the path: {messages}"
    with pytest.raises(SpecError, match="not allowed in a spec sent over HTTP"):
        loads_spec(f"name: w\nagents:\n  a: {{prompt_file: {existing}}}\n")  # text without a folder


# ---------------------------------------------------------------------------------------------------
# Limits for specs from the network


def many_agents(n: int, body: object = None) -> dict[str, Any]:
    return {"name": "big", "agents": {f"a{i}": body for i in range(n)}}


def test_agent_count_limit_is_checked_before_any_agent() -> None:
    limits = SpecLimits(max_agents=256, max_prompt_bytes=1 << 20, max_agents_setting="limits.max_agents_per_spec")
    # every agent here is invalid: the limit must answer first, without parsing them
    with pytest.raises(SpecLimitError) as info:
        parse_spec(many_agents(10_000, body=["not", "a", "mapping"]), limits=limits)
    err = info.value
    assert isinstance(err, SpecError) and err.field == "agents"
    assert err.message == "has 10000 agents; the limit is 256 (limits.max_agents_per_spec)"
    assert (err.limit, err.maximum, err.actual) == ("limits.max_agents_per_spec", 256, 10_000)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is SpecLimitError and str(copy) == str(err) and copy.actual == 10_000
    assert len(parse_spec(many_agents(256), limits=limits).agents) == 256
    assert len(parse_spec(many_agents(10_000)).agents) == 10_000  # no limits: none applied


def test_prompt_bytes_limit_counts_utf8_bytes_of_all_prompts() -> None:
    limits = SpecLimits(max_agents=10, max_prompt_bytes=100)
    data = {"name": "w", "agents": {"a": {"prompt": "é" * 30}, "b": {"prompt": "x" * 40, "after": ["a"]}}}
    assert parse_spec(data, limits=limits).agents["a"].prompt == "é" * 30  # 60 + 40 bytes: at the limit
    data["agents"]["b"]["prompt"] += "x"
    with pytest.raises(SpecLimitError) as info:
        parse_spec(data, limits=limits)
    assert info.value.field == "agents.b.prompt" and info.value.limit == "max_prompt_bytes"
    assert "the limit is 100 (max_prompt_bytes)" in info.value.message
    with pytest.raises(SpecLimitError, match=r"agents\.a\.prompt"):  # one huge prompt, cheaply
        parse_spec({"name": "w", "agents": {"a": {"prompt": "x" * 10_000_000}}}, limits=limits)
    assert parse_spec(data).agents["b"].prompt == "x" * 41


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10"])
def test_spec_limits_must_be_positive_integers(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_agents"):
        SpecLimits(max_agents=bad, max_prompt_bytes=1)
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        SpecLimits(max_agents=1, max_prompt_bytes=bad)


# ---------------------------------------------------------------------------------------------------
# YAML: no anchors/aliases, bounded size and depth


def test_alias_bomb_spec_is_refused_fast(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("name: w\nagents: {a: {}}\n" + ALIAS_BOMB)
    for load in (lambda: loads_spec(path.read_text()), lambda: load_spec(path)):
        start = time.monotonic()
        result = finishes_within(20, load)
        assert isinstance(result, SpecError), result
        assert result.field == "file" and "YAML aliases (*name) are not supported" in result.message
        assert "\n" not in str(result)
        assert time.monotonic() - start < 5


def test_yaml_aliases_and_anchors_are_refused() -> None:
    with pytest.raises(SpecError, match=r"YAML aliases \(\*name\) are not supported \(found \*x\)"):
        loads_spec("name: w\nagents: {a: *x}\n")
    with pytest.raises(SpecError, match=r"anchors \(&name\)"):
        loads_spec("name: w\nagents: &x {a: {}}\n")
    assert load_yaml("a: '&x *y'\nb: [1, 2]\n") == {"a": "&x *y", "b": [1, 2]}  # in strings they are text


def test_spec_file_size_encoding_and_depth(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"name: w\nagents: {a: {}}\n" + b"#" * MAX_SPEC_FILE_BYTES)
    with pytest.raises(SpecError, match=f"{MAX_SPEC_FILE_BYTES}-byte limit") as info:
        load_spec(big)
    assert info.value.field == "file"
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: w\nagents: {a: {prompt: café}}\n".encode("latin-1"))
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(latin1)
    for text in ("[" * 5000 + "]" * 5000, "a: " + "[" * 5000 + "]" * 5000, "{" + '"a": [' * 5000 + "]" * 5000 + "}"):
        with pytest.raises(SpecError, match="nested too deeply"):
            loads_spec(text)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="nested too deeply"):
        load_spec(deep_json)


# ---------------------------------------------------------------------------------------------------
# kvflow-ray serve --config


def serve_config(*argv: str) -> object:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return serve_command.app_config(parser.parse_args(list(argv)))


def test_serve_config_refuses_alias_bomb_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text("replicas: 1\n" + ALIAS_BOMB)
    start = time.monotonic()
    result = finishes_within(20, lambda: serve_config("--config", str(path)))
    assert isinstance(result, ValueError) and "YAML aliases (*name) are not supported" in str(result), result
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvflow-ray serve: error: cannot read --config") and err.count("\n") == 1, err
    assert time.monotonic() - start < 10


def test_serve_config_size_and_shape_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"replicas: 1\n" + b"#" * MAX_CONFIG_FILE_BYTES)
    profile = tmp_path / "profile.yaml"
    profile.write_text("engine: sim\nprofile: [a, b]\n")
    apps = tmp_path / "apps.yaml"
    apps.write_text("applications: not-a-list\n")
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("replicas: 1\nreplicas: 2\n")
    cases = [(big, f"{MAX_CONFIG_FILE_BYTES}-byte limit"), (profile, "profile"),
             (apps, "applications must be a list"), (duplicate, "duplicate key 'replicas'"),
             (tmp_path, "Is a directory"), (tmp_path / "missing.yaml", "No such file")]
    for path, fragment in cases:
        assert main(["serve", "--config", str(path)]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("kvflow-ray serve: error: ") and fragment in err, err
        assert err.count("\n") == 1 and "Traceback" not in err, err


def test_serve_config_from_the_repository_still_loads() -> None:
    config = serve_config("--config", str(REPO_ROOT / "deploy" / "serve-cpu.yaml"))
    assert config is not None
