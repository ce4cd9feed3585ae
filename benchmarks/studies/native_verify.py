"""Would native code close the gap of an embedded-store load through the SGLang tier? A batched verify in C.

The tier's load of N pages from Mooncake's embedded store copies each value
into the pool's pages (its header, K and V: three pieces) and then verifies
each page's XXH3-128 tag over every byte, in Python over ``xxhash``; the raw
get copies the same bytes once per page and checks nothing
(``kvconn bench sglang``: the tier at 0.53 of raw, target 0.9). The gap is the
tag pass: python-xxhash holds the GIL for updates of 64 KiB or less, so it
cannot overlap the copy. This study compiles a verify of a whole batch in C
(its XXH3 calls are python-xxhash's own, through the symbols its extension
module exports, so the tags are bit for bit the tier's), called through ctypes,
which gives up the GIL for the call, and times, side by side in interleaved
rounds on the same pages (fresh page slots, the same store values):

* ``raw get``: the store's batched ``get`` into one buffer per page;
* ``tier (Python)``: ``get_parts`` into header, K and V, then ``judge`` per page (the tier's in-place path);
* ``native, serial``: ``get_parts``, then one C call verifying every page;
* ``native, beside the copy``: ``get_parts`` chunk by chunk, a second thread verifying each landed chunk in C
  while the next one copies (what two cores could give, if they are there to give it).

Before timing, the C verify must agree with ``judge`` on every page, a damaged
tag and a damaged payload byte included. Needs a C compiler (``cc``) and the
Mooncake plugin: otherwise it says it cannot run (exit 2).

Usage: ``python benchmarks/studies/native_verify.py [--pages N] [--rounds R] [--chunk C] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import ctypes
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import CANNOT_RUN, Bench, arg_parser

#: The integrity header's layout (kvconn.store.integrity): the head (magic ... layout digest), then the tag over
#: the head and the payload. Checked against ``judge`` before anything is timed.
HEAD_BYTES, TAG_BYTES = 40, 16
PIECE = 64 * 1024  # K or V of one page: 16 tokens x 8 layers x 4 heads x 64 dims in fp16, as `kvconn bench sglang`

VERIFY_C = r"""
#include <stdint.h>
#include <string.h>
typedef struct { uint64_t low64, high64; } h128;
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef h128 (*digest_fn)(const void *);

/* ok[i] = whether header i starts with head i and carries XXH3-128(head i, its parts) as the tag after it. */
void verify_batch(void *state, reset_fn reset, update_fn update, digest_fn digest, int n, int head_len,
                  const uint8_t *const *heads, const uint8_t *const *headers, int parts,
                  const uint8_t *const *ptrs, const size_t *sizes, uint8_t *ok) {
    for (int i = 0; i < n; i++) {
        uint8_t tag[16];
        ok[i] = 0;
        if (memcmp(headers[i], heads[i], head_len)) continue;
        reset(state);
        update(state, heads[i], head_len);
        for (int j = 0; j < parts; j++) update(state, ptrs[i * parts + j], sizes[i * parts + j]);
        h128 h = digest(state);
        for (int b = 0; b < 8; b++) { tag[b] = h.high64 >> (56 - 8 * b); tag[8 + b] = h.low64 >> (56 - 8 * b); }
        ok[i] = memcmp(tag, headers[i] + head_len, 16) == 0;
    }
}
"""


class _H128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _native() -> tuple[Any, Any]:
    """(the compiled verify, python-xxhash's extension module as a library); ``RuntimeError`` naming what is missing."""
    import xxhash._xxhash as xxh_module  # the extension module, which exports the XXH3 C API

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    xxh = ctypes.CDLL(xxh_module.__file__)
    for name in ("XXH3_createState", "XXH3_128bits_reset", "XXH3_128bits_update", "XXH3_128bits_digest"):
        if not hasattr(xxh, name):
            raise RuntimeError(f"python-xxhash's extension module does not export {name}")
    xxh.XXH3_createState.restype = ctypes.c_void_p
    with tempfile.TemporaryDirectory(prefix="kvconn-native-verify-") as tmp:  # a loaded library outlives its file
        build = Path(tmp)
        (build / "verify.c").write_text(VERIFY_C)
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(build / "verify.so"), str(build / "verify.c")]
        subprocess.run(command, check=True, capture_output=True)
        lib = ctypes.CDLL(str(build / "verify.so"))
    p = ctypes.c_void_p
    lib.verify_batch.argtypes = [p, p, p, p, ctypes.c_int, ctypes.c_int, p, p, ctypes.c_int, p, p, p]
    lib.verify_batch.restype = None
    return lib, xxh


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Pages:
    """N pages saved in an embedded store through the tier's sealing, and slots to load them into."""

    def __init__(self, pages: int) -> None:
        from kvconn.store import HEADER_BYTES, Integrity
        from kvconn.store.values import seal_parts
        from kvconn_mooncake.embedded import EmbeddedStore
        from kvconn_mooncake.store import MooncakeBlockStore

        self.n, self.integrity, self.layout = pages, Integrity(), b"pagelay0"
        pool = memoryview(bytearray(4 * pages * PIECE))  # saved K, loaded K, saved V, loaded V: page_first-like
        piece = [pool[i * PIECE : (i + 1) * PIECE] for i in range(4 * pages)]
        saved = [[piece[i], piece[2 * pages + i]] for i in range(pages)]
        self.slots = [[piece[pages + i], piece[3 * pages + i]] for i in range(pages)]
        for page in saved:
            for part in page:
                part[:] = uuid.uuid4().bytes * (PIECE // 16)
        self.keys = [uuid.uuid4().bytes for _ in range(pages)]
        self.store = MooncakeBlockStore.embedded(EmbeddedStore(1 << 30))
        sealed = seal_parts(self.integrity, self.keys, self.layout, saved, 2 * PIECE)
        assert all(self.store.put_parts(self.keys, sealed))
        self.heads = [bytes(value[0][:HEAD_BYTES]) for value in sealed]  # what the tier derives from each key
        headers = memoryview(bytearray(pages * HEADER_BYTES))
        self.headers = [headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(pages)]
        self.parts = [[header, *slot] for header, slot in zip(self.headers, self.slots, strict=True)]
        self.buffers = [memoryview(bytearray(HEADER_BYTES + 2 * PIECE)) for _ in range(pages)]

    def judge_all(self, lengths: list[int | None]) -> list[bool]:
        """The tier's own verdicts (``judge``) on what the slots hold now, read as ``lengths`` bytes per value."""
        from kvconn.store.values import judge

        return [
            judge(self.integrity, key, self.layout, length, header, slot, 2 * PIECE) is None
            for key, length, header, slot in zip(self.keys, lengths, self.headers, self.slots, strict=True)
        ]

    def load(self) -> list[int | None]:
        """Every page's value into its header and slot (the tier's in-place ``get_parts``)."""
        return self.store.get_parts(self.keys, self.parts)


class NativeVerify:
    """The C verify over a range of pages, with its arguments built once (the tier would keep them per pool)."""

    def __init__(self, pages: Pages, lib: Any, xxh: Any) -> None:
        self.lib, n = lib, pages.n
        self.fns = [
            ctypes.cast(getattr(xxh, f"XXH3_128bits_{f}"), ctypes.c_void_p) for f in ("reset", "update", "digest")
        ]
        self.states = [ctypes.c_void_p(xxh.XXH3_createState()) for _ in range(2)]  # one per thread
        self.heads = (ctypes.c_char_p * n)(*pages.heads)
        self.headers = (ctypes.c_void_p * n)(*map(_address, pages.headers))
        self.ptrs = (ctypes.c_void_p * (2 * n))(*[_address(part) for slot in pages.slots for part in slot])
        self.sizes = (ctypes.c_size_t * (2 * n))(*[part.nbytes for slot in pages.slots for part in slot])
        self.ok = (ctypes.c_uint8 * n)()

    def __call__(self, lo: int, hi: int, thread: int = 0) -> None:
        void_pp = ctypes.POINTER(ctypes.c_void_p)
        self.lib.verify_batch(
            self.states[thread], *self.fns, hi - lo, HEAD_BYTES,
            ctypes.cast(ctypes.byref(self.heads, lo * ctypes.sizeof(ctypes.c_char_p)), void_pp),
            ctypes.cast(ctypes.byref(self.headers, lo * ctypes.sizeof(ctypes.c_void_p)), void_pp), 2,
            ctypes.cast(ctypes.byref(self.ptrs, 2 * lo * ctypes.sizeof(ctypes.c_void_p)), void_pp),
            ctypes.byref(self.sizes, 2 * lo * ctypes.sizeof(ctypes.c_size_t)),
            ctypes.byref(self.ok, lo),
        )  # fmt: skip

    def verdicts(self) -> list[bool]:
        return [bool(x) for x in self.ok]


def _variants(
    pages: Pages, native: NativeVerify, chunk: int
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """The four loads, and a function stopping the verify thread."""
    jobs: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[None] = queue.SimpleQueue()

    def verifier() -> None:
        while (job := jobs.get()) is not None:
            native(*job, thread=1)
            done.put(None)

    threading.Thread(target=verifier, daemon=True).start()
    n, keys, parts = pages.n, pages.keys, pages.parts

    def beside() -> None:
        chunks = range(0, n, chunk)
        for lo in chunks:
            pages.store.get_parts(keys[lo : lo + chunk], parts[lo : lo + chunk])
            jobs.put((lo, min(n, lo + chunk)))
        for _ in chunks:
            done.get()

    variants: dict[str, Callable[[], object]] = {
        "raw get": lambda: pages.store.get(keys, pages.buffers),
        "tier (Python)": lambda: pages.judge_all(pages.load()),
        "native, serial": lambda: (pages.load(), native(0, n)),
        "native, beside the copy": beside,
    }
    return variants, lambda: jobs.put(None)


def _agree(pages: Pages, native: NativeVerify) -> None:
    """The C verify's verdicts are ``judge``'s, on good pages and on a damaged tag and payload byte."""
    lengths = pages.load()
    native(0, pages.n)
    assert native.verdicts() == pages.judge_all(lengths) == [True] * pages.n, "the C verify disagrees with judge"
    pages.headers[0][HEAD_BYTES] ^= 1
    pages.slots[-1][1][7] ^= 1
    native(0, pages.n)
    verdicts = native.verdicts()
    assert verdicts == pages.judge_all(lengths) and not verdicts[0] and not verdicts[-1], "the C verify missed damage"


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=16, help="pages a chunk copies before the thread verifies it")
    args = parser.parse_args()
    try:
        import kvconn_mooncake  # noqa: F401

        lib, xxh = _native()
    except (ImportError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"cannot run here: {exc}", file=sys.stderr)
        return CANNOT_RUN
    pages_n, rounds = (8, 5) if args.quick else (args.pages, args.rounds)
    pages = Pages(pages_n)
    native = NativeVerify(pages, lib, xxh)
    variants, stop = _variants(pages, native, min(args.chunk, pages_n))
    _agree(pages, native)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds + 1):  # round 0 warms up
        for name in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            variants[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    stop()
    bench = Bench(f"an embedded-store load of {pages_n} pages of 128 KiB: verified in Python and in C",
                  ["load", "median ms", "fastest ms", "raw / load (median)", "raw / load (fastest)"])  # fmt: skip
    raw_med, raw_min = statistics.median(times["raw get"]), min(times["raw get"])
    for name, seconds in times.items():
        med, fastest = statistics.median(seconds), min(seconds)
        bench.row(name, 1000 * med, 1000 * fastest, raw_med / med, raw_min / fastest)
    bench.notes.append(f"{rounds} interleaved rounds; the thread verifies chunks of {min(args.chunk, pages_n)} pages")
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
