"""``kvconn.adapters.vllm``, the path DESIGN.md and vLLM configs name, is an alias of ``kvconn_vllm``."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import kvconn_vllm


def test_the_alias_hands_out_the_adapters_own_objects() -> None:
    import kvconn.adapters.vllm as alias

    assert alias.register is kvconn_vllm.register
    assert alias.SHORT_NAME == kvconn_vllm.SHORT_NAME
    assert set(kvconn_vllm.__all__) <= set(alias.__all__)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_importing_the_alias_imports_neither_vllm_nor_torch() -> None:
    probe = _python("import sys, kvconn.adapters.vllm; print(sorted({'vllm', 'torch'} & set(sys.modules)))")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


def test_without_the_adapter_the_alias_says_what_to_install() -> None:
    # sys.modules[name] = None makes `import kvconn_vllm` fail as if the distribution were absent.
    probe = _python("import sys; sys.modules['kvconn_vllm'] = None; import kvconn.adapters.vllm")
    assert probe.returncode == 1
    adapter = Path(kvconn_vllm.__file__).parents[2]  # adapters/vllm in this checkout
    assert probe.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: kvconn.adapters.vllm is the kvconn-vllm distribution: install it to run kvconn "
        f"connectors inside vLLM: {shlex.join([sys.executable, '-m', 'pip', 'install', '-e', str(adapter)])}"
    )
