"""The tensor form of messages (wire/message_torch.py) against the numpy form (wire/message.py):
bitwise the same encoding, and on valid, damaged and random messages the same decode outcome
(the same sections and indices, or the same WireError/RemoteError message). CPU tensors; the
code has no device-specific branch."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_slim.wire import WireError, control
from hvd_slim.wire import message as wm
from hvd_slim.wire import message_torch as wt

from test_fuzz_wire import damaged, message

WHO = "push from rank 2"


def fuzz(examples):
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def as_tensor(buf: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(buf, dtype=np.uint8, copy=True))


def outcome(decode, buf, expect):
    """What decoding ``buf`` gives: its sections as plain bytes, or the error raised."""
    try:
        out = decode(buf, kind=wm.PUSH, sender=2, step=17, digest=0xC0FFEE, expect=expect,
                     who=WHO)
    except (WireError, wm.RemoteError) as exc:
        return ("error", type(exc).__name__, str(exc), getattr(exc, "code", None))
    rows = []
    for s in out:
        idx = None if s.indices is None else np.asarray(
            s.indices.numpy() if isinstance(s.indices, torch.Tensor) else s.indices).tolist()
        vals = s.values.numpy() if isinstance(s.values, torch.Tensor) else s.values
        ib = s.idx_bytes.numpy() if isinstance(s.idx_bytes, torch.Tensor) else s.idx_bytes
        rows.append((s.mode, s.count, s.idx_kind, s.exp, bytes(vals), bytes(ib), idx))
    return ("ok", rows)


def tensor_message(seed):
    """message(seed) built again through the tensor encoder: the same sections as tensors."""
    buf, expect, sizes = message(seed)
    out = wm.decode(buf, kind=wm.PUSH, sender=2, step=17, digest=0xC0FFEE, expect=expect, who=WHO)
    secs = []
    for s, ex in zip(out, expect):
        vals = torch.from_numpy(s.values.copy())
        idx = None if s.indices is None else torch.from_numpy(s.indices.copy())
        secs.append(wt.make_section(s.mode, vals, ex.d, idx, s.exp) if s.mode != wm.M_EMPTY
                    else wt.empty_section(wm.M_EMPTY, torch.device("cpu")))
    tbuf, sizes_t = wt.encode(wm.PUSH, 2, 17, 0xC0FFEE, secs, sizes, torch.device("cpu"))
    return buf, tbuf, expect, sizes_t


@fuzz(300)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_the_tensor_encoder_writes_the_same_bytes(seed):
    buf, tbuf, expect, sizes = tensor_message(seed)
    assert tbuf.dtype == torch.uint8 and tbuf.dim() == 1
    assert np.array_equal(tbuf.numpy(), buf)
    assert sizes["header"] + sizes["values"] + sizes["indices"] == len(buf)
    assert outcome(wt.decode, tbuf, expect) == outcome(wm.decode, buf, expect)


@fuzz(2500)
@given(seed=st.integers(0, 2 ** 32 - 1), mutation=st.sampled_from(
    ["truncate", "extend", "header", "table", "flip", "random"]),
    edge=st.sampled_from(["zero", "one", "max", "next", "previous", "random"]))
def test_damaged_messages_decode_identically(seed, mutation, edge):
    buf, expect, _ = message(seed)
    bad = damaged(buf, expect, np.random.default_rng(seed + 1), mutation, edge)
    assert outcome(wt.decode, as_tensor(bad), expect) == outcome(wm.decode, bad, expect)


def test_text_messages_peek_and_errors_match():
    expect = message(5)[1]
    msgs = [wm.encode_error(0, 17, "server rank 0 failed: boom", code=wm.E_NONFINITE),
            control.encode_text(wm.SKIP, 2, 17, 0xC0FFEE, "skipped: NaN"),
            control.encode_text(wm.NONFINITE, 2, 17, 0xC0FFEE, "NaN/Inf in 'w'"),
            control.encode_control(wm.HELLO, 2, 17, 0xC0FFEE), message(9)[0]]
    for m in msgs:
        t = as_tensor(m)
        assert wt.is_error(t) == wm.is_error(m)
        try:
            want = ("ok", wm.peek(m, WHO))
        except (WireError, wm.RemoteError) as exc:
            want = ("error", type(exc).__name__, str(exc))
        try:
            got = ("ok", wt.peek(t, WHO))
        except (WireError, wm.RemoteError) as exc:
            got = ("error", type(exc).__name__, str(exc))
        assert got == want
        assert outcome(wt.decode, t, expect) == outcome(wm.decode, m, expect)
        host = wt.host_text(t)
        if int(m[5]) in wm.TEXT_KINDS:
            assert isinstance(host, np.ndarray) and np.array_equal(host, m)
        else:
            assert host is t
    assert np.array_equal(wt.from_host(msgs[1], torch.device("cpu")).numpy(), msgs[1])


def test_wrong_containers_are_wire_errors():
    buf, expect, _ = message(3)
    t = as_tensor(buf)
    for bad in (t.view(torch.int8), t.float(), t.reshape(1, -1), t[::2], buf):
        with pytest.raises(WireError):
            wt.decode(bad, kind=wm.PUSH, sender=2, step=17, digest=0xC0FFEE, expect=expect,
                      who=WHO)


def test_decoding_reads_only_the_header_and_table_on_the_host(monkeypatch):
    """A message's values and indices never go through numpy: only the first
    header + table bytes are converted (the host copy on a GPU)."""
    buf, tbuf, expect, _ = tensor_message(11)
    limit = wm.HEADER.size + wm.ENTRY.size * len(expect)
    seen = []
    real = torch.Tensor.numpy

    def spy(self, *a, **k):
        seen.append(self.numel() * self.element_size())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", spy)
    wt.decode(tbuf, kind=wm.PUSH, sender=2, step=17, digest=0xC0FFEE, expect=expect, who=WHO)
    assert seen and max(seen) <= limit < len(buf)
