"""The adapter's per-step metadata through pickle (vLLM's ``MessageQueue``), against forms that might pickle cheaper.

Issue 27 item 3: in a vLLM step the metadata's pickle round trip costs 7-11 µs of kvconn's ~40 µs at 64
running requests (benchmarks/history/2026-log.md). What a cheaper form could save, measured warm and side by side
(:func:`benchlib.round_times`), for the metadata of a step with no load in flight (one connector's
encoded metadata, no loads, no failed loads, nothing dropped):

* ``adapter``: :class:`kvconn_vllm.KVConnVllmMetadata` (a dataclass; ``__reduce__`` to its class and fields);
* ``msgspec Struct``: the same fields in a ``msgspec.Struct`` that is also vLLM's ``KVConnectorMetadata``
  (construction, ``__reduce__`` and re-construction in C);
* ``tuple subclass``: a ``tuple`` that is also a ``KVConnectorMetadata`` (pickled by ``NEWOBJ`` in C, no
  Python frame at either end);
* ``plain tuple``: the fields as a builtin tuple, no class at all: the floor of any form, and not one the
  adapter may send (vLLM types the metadata ``KVConnectorMetadata``);
* ``class alone``: pickling only the adapter's class (a reference by module and name): what every form with
  a class pays for its one global (and ``Struct's class alone``: the same for a class of this script, so a
  difference between the forms' modules shows).

Per form: construction, ``dumps``, ``loads`` and the round trip, µs. Runs in the vLLM venv
(``.venv-vllm/bin/python benchmarks/studies/vllm_metadata_pickle.py``).
"""

from __future__ import annotations

import abc
import pickle
import statistics
import sys
from collections.abc import Callable
from typing import Any

from benchlib import CANNOT_RUN, Bench, parse_args, round_times

__all__ = ["forms", "main"]


def forms() -> dict[str, tuple[Callable[[], Any], Any]]:
    """Each form's name -> (a function building it, the object); every object carries the same fields."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    import kvconn
    from kvconn.host.wire import encode_metadata
    from kvconn_vllm import KVConnVllmMetadata

    class StructMeta(type(msgspec.Struct), abc.ABCMeta):  # type: ignore[misc]
        """msgspec's metaclass and vLLM's (an ABC)."""

    class StructMetadata(msgspec.Struct, KVConnectorMetadata, metaclass=StructMeta):  # type: ignore[misc]
        connectors: dict[str, bytes] = {}
        loads: dict[str, Any] = {}
        failed_loads: dict[str, Any] = {}
        dropped: list[str] = []
        report: bool = False

    class TupleMetadata(tuple, KVConnectorMetadata):  # type: ignore[type-arg,misc]
        __slots__ = ()

    # Pickle finds a class by its module and name: these must be reachable as this module's globals.
    for cls in (StructMetadata, TupleMetadata):
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls

    encoded = {"noop": encode_metadata("noop", kvconn.KVConnectorMetadata())}

    def fields() -> tuple[Any, ...]:
        return (encoded, {}, {}, [], False)

    builders: dict[str, Callable[[], Any]] = {
        "adapter": lambda: KVConnVllmMetadata(*fields()),
        "msgspec Struct": lambda: StructMetadata(*fields()),
        "tuple subclass": lambda: tuple.__new__(TupleMetadata, fields()),
        "plain tuple": fields,
    }
    out = {name: (build, build()) for name, build in builders.items()}
    out["class alone"] = (lambda: KVConnVllmMetadata, KVConnVllmMetadata)
    out["Struct's class alone"] = (lambda: StructMetadata, StructMetadata)  # a class of this script's module
    for name, (_, obj) in out.items():  # each form survives the trip with its fields
        back = pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back) is type(obj), name
        if isinstance(obj, type):
            continue
        if name != "plain tuple":
            assert isinstance(back, KVConnectorMetadata), name
        as_fields = tuple(back) if isinstance(back, tuple) else tuple(getattr(back, f) for f in _FIELDS)
        assert as_fields == fields(), name
    return out


_FIELDS = ("connectors", "loads", "failed_loads", "dropped", "report")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"cannot run: vLLM is not installed here ({exc}); use .venv-vllm/bin/python", file=sys.stderr)
        return CANNOT_RUN
    protocol = pickle.HIGHEST_PROTOCOL
    table = forms()
    fns: list[Callable[[], Any]] = []
    for build, obj in table.values():
        data = pickle.dumps(obj, protocol=protocol)
        fns += [
            build,
            lambda o=obj: pickle.dumps(o, protocol=protocol),
            lambda d=data: pickle.loads(d),
            lambda o=obj: pickle.loads(pickle.dumps(o, protocol=protocol)),
        ]
    rounds = round_times(*fns, repeat=3 if args.quick else 21, min_time=0.005 if args.quick else 0.05)
    us = [statistics.median(r) * 1e6 for r in rounds]
    columns = ["form", "bytes", "construct us", "dumps us", "loads us", "round trip us", "round trip / adapter"]
    bench = Bench("the adapter's metadata through pickle, per form (warm, us)", columns)
    adapter_trip = us[3]
    for i, (name, (_, obj)) in enumerate(table.items()):
        build, dumps, loads, trip = us[4 * i : 4 * i + 4]
        size = len(pickle.dumps(obj, protocol=protocol))
        bench.row(name, size, build, dumps, loads, trip, trip / adapter_trip)
    bench.notes.append(
        "medians of interleaved rounds (the order rotated each round); 'class alone': pickling the adapter's class "
        "object only, i.e. the cost of one class reference (module import check on dumps, lookup on loads)"
    )
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
