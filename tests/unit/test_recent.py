"""The memo of recent results (wire/recent.py): a server decoding its own push, or a worker
regenerating an exploration set it drew, gets exactly what a fresh computation gives."""
import numpy as np
import pytest
import torch

from hvd_slim.selection.explore import RECENT as EXPLORED
from hvd_slim.selection.explore import _coordinates, _positions, explore
from hvd_slim.wire import index_codec
from hvd_slim.wire import indices as codec
from hvd_slim.wire import indices_torch as codec_torch
from hvd_slim.wire.errors import WireError
from hvd_slim.wire.recent import Recent


def test_a_hit_needs_an_equal_witness_and_hands_out_copies():
    memo = Recent(max_bytes=1 << 20)
    w, v = np.arange(10), np.arange(5) * 3
    memo.put("k", w, v)
    w[0], v[0] = 99, 99   # the memo kept copies
    got = memo.get("k", np.arange(10))
    assert np.array_equal(got, np.arange(5) * 3)
    got[1] = -1           # and hands out copies
    assert np.array_equal(memo.get("k", np.arange(10)), np.arange(5) * 3)
    assert memo.get("k", np.arange(1, 11)) is None     # same key, other witness
    assert memo.get("k", torch.arange(10)) is None     # another array type
    assert memo.get("other", np.arange(10)) is None


def test_the_oldest_entries_go_first_within_the_byte_cap():
    memo = Recent(max_bytes=3 * 2 * 8 * 100)   # three entries of two 100-element int64 arrays
    for i in range(5):
        memo.put(i, np.full(100, i), np.full(100, -i))
    assert [memo.get(i, np.full(100, i)) is None for i in range(5)] == [True, True] + [False] * 3
    memo.put("big", np.zeros(1000), np.zeros(1000))   # larger than the cap: not kept
    assert memo.get("big", np.zeros(1000)) is None


@pytest.mark.parametrize("mod", [codec, codec_torch], ids=["numpy", "torch"])
def test_decoding_what_this_process_encoded_matches_a_fresh_decode(mod):
    rng = np.random.default_rng(3)
    d, n = 1 << 20, 20_000
    idx = np.sort(rng.choice(d, n, replace=False)).astype(np.int64)
    arr = idx if mod is codec else torch.from_numpy(idx)
    kind, enc = mod.encode_indices(arr, d)
    before = index_codec.RECENT.hits
    got = mod.decode_indices(kind, enc, d, n)
    assert index_codec.RECENT.hits == before + 1
    assert np.array_equal(np.asarray(got), idx)
    # Another payload of the same size is decoded, not recalled: flip one low-section bit.
    other = enc.copy() if mod is codec else enc.clone()
    other[0] ^= 0x80
    fresh = mod.decode_indices(kind, other, d, n)
    assert index_codec.RECENT.hits == before + 1
    assert not np.array_equal(np.asarray(fresh), idx)
    # A bad payload of the right length still raises: set a padding bit of the high section.
    bad = enc.copy() if mod is codec else enc.clone()
    bad[-1] |= 1
    try:
        mod.decode_indices(kind, bad, d, n)
    except WireError:
        pass
    else:   # the last bit may be a real one: then it is a different, valid set
        assert index_codec.RECENT.hits == before + 1


def test_a_recalled_exploration_set_is_the_one_drawn_afresh():
    rng = np.random.default_rng(4)
    d = 1 << 20
    core = torch.from_numpy(np.sort(rng.choice(d, 30_000, replace=False)).astype(np.int64))
    key = (7, 0, 1, 12, 0)
    first = explore(d, core, 3000, key)
    before = EXPLORED.hits
    again = explore(d, core.clone(), 3000, key)
    assert EXPLORED.hits == before + 1 and torch.equal(first, again)
    # The same key with another core is drawn afresh.
    other = core[1:]
    drawn = explore(d, other, 3000, key)
    assert EXPLORED.hits == before + 1
    fresh = _coordinates(other.numpy(), _positions(key, d - other.numel(), 3000), False)
    assert torch.equal(drawn, fresh) and not torch.equal(drawn, first)
