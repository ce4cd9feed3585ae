"""Store key namespaces (kvconn.store.BlockKeys): engines whose blocks differ in meaning never share a key."""

from __future__ import annotations

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvconn import ConnectorContext, KVCacheGroupSpec
from kvconn.hashing import context_namespace
from kvconn.store import KEY_VERSION, BlockKeys
from kvconn.store.integrity import secret_id

# Small domains, so that drawn contexts often agree on all fields but one; names with separators
# (",", "/") probe encodings that join fields into one string.
names = st.sampled_from(["layer.0", "layer.1", "layer.0,layer.1", "a,b", "a", "b", "x/y", ""])
groups = st.builds(
    KVCacheGroupSpec, st.lists(names, min_size=1, max_size=3, unique=True).map(tuple), st.sampled_from([None, 16, 32])
)
# A context refuses a layer named in two groups: layouts are drawn with each layer once.
layouts = st.lists(groups, min_size=1, max_size=2).filter(
    lambda gs: len({n for g in gs for n in g.layer_names}) == sum(len(g.layer_names) for g in gs)
)
contexts = st.sampled_from([(0, 1), (0, 2), (1, 2)]).flatmap(
    lambda rank_size: st.builds(
        ConnectorContext,
        model=st.sampled_from(["m", "m,n", "n", "m/1"]),
        dtype=st.sampled_from(["float16", "bfloat16"]),
        block_size=st.sampled_from([16, 32]),
        kv_cache_groups=layouts.map(tuple),
        kv_layout=st.sampled_from(["NHD", "HND"]),
        tp_rank=st.just(rank_size[0]),
        tp_size=st.just(rank_size[1]),
        engine_id=st.sampled_from(["e1", "e2"]),
    )
)
secrets = st.sampled_from([None, "s" * 16, "t" * 16])
DEFAULT = ConnectorContext()
COMMA = ConnectorContext(kv_cache_groups=(KVCacheGroupSpec(("layer.0,layer.1",)),))


def _meaning(context: ConnectorContext) -> dict[str, object]:
    """Every field that changes what a block's bytes mean (all but the engine instance's id)."""
    fields = msgspec.structs.asdict(context)
    del fields["engine_id"]
    return fields


@settings(max_examples=400, deadline=None)
@given(a=contexts, b=contexts, secret_a=secrets, secret_b=secrets, block_hash=st.binary(min_size=32, max_size=32))
@example(a=DEFAULT, b=COMMA, secret_a=None, secret_b=None, block_hash=bytes(32))
def test_contexts_that_differ_in_any_field_never_share_a_key(
    a: ConnectorContext, b: ConnectorContext, secret_a: str | None, secret_b: str | None, block_hash: bytes
) -> None:
    keys_a = BlockKeys(a, secret_id=secret_id(secret_a))
    keys_b = BlockKeys(b, secret_id=secret_id(secret_b))
    for_a = {(g, keys_a.key(g, block_hash)) for g in range(len(a.kv_cache_groups))}
    for_b = {(g, keys_b.key(g, block_hash)) for g in range(len(b.kv_cache_groups))}
    shared = {key for _, key in for_a} & {key for _, key in for_b}
    if _meaning(a) != _meaning(b) or secret_a != secret_b:
        assert not shared
    else:  # alike engines share every block, group for group, whatever their engine ids
        assert for_a == for_b
    assert len({key for _, key in for_a}) == len(for_a)  # groups of one engine never share a key


def test_the_namespace_is_the_sdks() -> None:
    prefix = BlockKeys(DEFAULT, "mine").prefixes[0]
    assert prefix == f"kvconn/{context_namespace(DEFAULT, KEY_VERSION, 'mine', 0, '')}/".encode()
    assert BlockKeys(DEFAULT, "yours").prefixes[0] != prefix  # the config's namespace separates runs
