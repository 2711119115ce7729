"""The config the operator renders is what `kvpilot serve --config FILE` accepts (examples end to end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.api.models import InferenceModel
from kvpilot.cli import build_parser
from kvpilot.operator.builders import CONFIG_PATH, OperatorSettings, render_children

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [
    (path, doc)
    for path in sorted((ROOT / "examples").glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc
    and doc.get("kind") == "InferenceModel"
    # vLLM-engine examples render `vllm serve` (CEL-checked in tests/api/test_cel.py; vLLM's own parser reads
    # a rendered config in tests/operator/test_vllm_pod.py)
    and doc["spec"].get("engine", "kvpilot") == "kvpilot"
]


@pytest.mark.parametrize(
    ("path", "doc"), EXAMPLES, ids=[f"{p.name}:{d['metadata']['name']}" for p, d in EXAMPLES]
)
def test_serve_accepts_the_rendered_config(path: Path, doc: dict[str, Any], tmp_path: Path) -> None:
    from kvpilot.runtime import cli as runtime_cli

    im = InferenceModel.model_validate(
        {**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "u"}}
    )
    children = {c["kind"]: c for c in render_children(im, OperatorSettings())}
    config_file = tmp_path / "config.yaml"
    config_file.write_text(children["ConfigMap"]["data"]["config.yaml"])

    command = children["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["kvpilot", "serve", "--config", CONFIG_PATH]
    argv = [*command[1:3], str(config_file), *command[4:]]
    cfg = runtime_cli.build_config(build_parser(argv).parse_args(argv))
    assert cfg.port == 8000 and cfg.host == "0.0.0.0"
    assert cfg.served_model_name == (doc["spec"]["model"].get("servedName") or doc["metadata"]["name"])
    for key, value in (doc["spec"].get("runtime") or {}).items():
        if key == "shutdownTimeoutSeconds":
            assert cfg.shutdown_timeout == value
        else:
            snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
            assert getattr(cfg, snake) == value, key


def test_the_operator_knows_the_runtimes_cpu_kv_pool_default() -> None:
    """oom.py halves the CPU KV pool from the runtime's default without importing torch."""
    from kvpilot.operator import oom
    from kvpilot.runtime.engine.runner import CPU_DEFAULT_KV_BYTES

    assert oom.CPU_DEFAULT_KV_BYTES == CPU_DEFAULT_KV_BYTES
