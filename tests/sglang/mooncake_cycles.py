"""Run inside a network namespace by test_mooncake_real.py: SGLang's controller over a real Mooncake master.

The master's address comes from the ``MC_*`` variables the netns harness sets. Prints one ``RESULT {json}``
line: what each cycle got, for the test to judge.
"""

from __future__ import annotations

import json
import os
import uuid

import torch

from kvconn.store import HEADER_BYTES
from kvconn_sglang.testing.rig import PAGE, Controller, extra, fill_known, make_pools, page


def main() -> None:
    config = {
        "master_server_address": os.environ["MC_MASTER_ADDR"],
        "metadata_server": os.environ["MC_METADATA_URL"],
        "local_hostname": os.environ["MC_LOCAL_HOSTNAME"],
        "namespace": uuid.uuid4().hex,
        "timeout_s": 10.0,
    }
    result: dict[str, object] = {}
    device, host = make_pools("mha", "page_first")
    ctl = Controller(device, host, extra("mooncake", config))
    fill_known(host, seed=1)
    tokens = list(range(1000, 1000 + 5 * PAGE))
    saved = host.alloc(3 * PAGE)
    result["backed_up"] = ctl.backup(tokens[: 3 * PAGE], saved)
    got = ctl.prefetch(tokens)
    result["partial"] = [got.hit_tokens, got.loaded_tokens]
    result["exact"] = all(torch.equal(page(host, saved, i), page(host, got.host_indices, i)) for i in range(3))
    # A foreign value under a page's key before SGLang saves it: the prefetch stops before it.
    more = list(range(9000, 9000 + 3 * PAGE))
    tier = ctl.backend.tier
    bad = tier.key(ctl.hashes(more)[1])
    tier.guard.call("put", lambda s: s.put([bad], [b"\x11" * (HEADER_BYTES + tier.views.page_bytes)]))
    ctl.backup(more, host.alloc(len(more)))
    corrupt = ctl.prefetch(more)
    result["corrupt"] = [corrupt.hit_tokens, corrupt.loaded_tokens]
    ctl.close()
    device, host = make_pools("mla", "page_first")
    other = Controller(device, host, extra("mooncake", config))
    result["mla_reads_mha"] = other.prefetch(tokens).hit_tokens
    other.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
