"""steer_add: torch reference vs the definition, and the Triton kernel vs the reference on random
inputs. On CUDA the kernel runs natively; on CPU it runs under TRITON_INTERPRET=1 in a
subprocess (the interpreter must be switched on before triton.jit decorates the kernel)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from vllm_xmix.kernels.steer_add import steer_add_reference

pytestmark = pytest.mark.one_version  # no vLLM path: runs on the primary vLLM only (CONTRIBUTING.md)

CASES = [  # (T, D, n_slots, n_entries_total, site_entries)
    (7, 64, 4, 3, [0, 2]),
    (1, 96, 3, 1, [0]),
    (33, 1000, 5, 4, [3, 1, 0]),
    (0, 64, 2, 1, [0]),
]


def make_inputs(T, D, S, E, entries, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype).to(device)
    tok_slot = torch.randint(0, S, (T + 5,), generator=g, dtype=torch.int32).to(device)
    coef = torch.randn(S, E, generator=g)
    coef[0] = 0.0  # null slot
    coef[coef.abs() < 0.3] = 0.0  # some entries off inside active slots
    vectors = torch.randn(E, D, generator=g)
    return h, tok_slot, coef.to(device), torch.tensor(entries, dtype=torch.int32, device=device), vectors.to(device)


def definition(h, tok_slot, coef, entries, vectors):
    """The semantics written as a plain loop (the docstring of kernels/steer_add.py)."""
    out = h.clone()
    for t in range(h.shape[0]):
        c = coef[int(tok_slot[t]), entries.long()]
        if bool((c != 0).any()):
            acc = torch.zeros(h.shape[1], dtype=torch.float32)
            for i, e in enumerate(entries.tolist()):
                acc += c[i] * vectors[e].float()
            out[t] = (h[t].float() + acc).to(h.dtype)
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_definition(case, dtype):
    T, D, S, E, entries = case
    h, tok_slot, coef, ent, vec = make_inputs(T, D, S, E, entries, dtype, "cpu")
    want = definition(h, tok_slot, coef, ent, vec)
    got = h.clone()
    steer_add_reference(got, tok_slot, coef, ent, vec)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    # rows whose slot has no active entry are untouched, bit for bit
    inactive = ~(coef[tok_slot[:T].long()][:, ent.long()] != 0).any(1)
    assert torch.equal(got[inactive], h[inactive])
    if len(entries) == 1:  # a single entry is exactly h + c*v in fp32, then rounded
        assert torch.equal(got, want)


def _triton_check(device: str) -> None:
    from vllm_xmix.kernels.steer_add import steer_add_triton

    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            T, D, S, E, entries = case
            h, tok_slot, coef, ent, vec = make_inputs(T, D, S, E, entries, dtype, device, seed=T + D)
            want = h.clone()
            steer_add_reference(want, tok_slot, coef, ent, vec)
            got = h.clone()
            steer_add_triton(got, tok_slot, coef, ent, vec)
            if len(entries) == 1 or dtype == torch.float32:
                tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
            else:
                tol = dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got, want, **tol)
            inactive = ~(coef[tok_slot[:T].long()][:, ent.long()] != 0).any(1)
            assert torch.equal(got[inactive], h[inactive]), "inactive rows must be bit-identical"
    # a non-contiguous row stride (a view into a wider buffer), as vLLM's residual can be
    big = torch.randn(9, 160, device=device)
    h = big[:, :128]
    tok_slot = torch.tensor([1] * 9 + [0], dtype=torch.int32, device=device)
    coef = torch.tensor([[0.0], [2.0]], device=device)
    vec = torch.randn(1, 128, device=device)
    want = h.clone() + 2.0 * vec
    steer_add_triton(h, tok_slot, coef, torch.tensor([0], dtype=torch.int32, device=device), vec)
    torch.testing.assert_close(h, want)
    assert torch.equal(big[:, 128:], big[:, 128:].clone())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_matches_reference_cuda():
    _triton_check("cuda")


def run_interpreted(check: str) -> None:
    """Run ``test_kernels.<check>('cpu')`` in a child with TRITON_INTERPRET=1 (the interpreter
    must be on before triton.jit decorates the kernels); skipped on a CUDA box."""
    if torch.cuda.is_available():
        pytest.skip("native CUDA test covers the kernel")
    code = "import sys; sys.path.insert(0, %r); import test_kernels as t; t.%s('cpu'); print('OK')" % (
        os.path.dirname(__file__), check)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_triton_matches_reference_interpreter():
    run_interpreted("_triton_check")


# ------------------------------------------------------------------ row_write (ablate / clamp / add)

ROW_CASES = [  # (T, D, S, kinds of all entries, site entries, with other)
    (6, 64, 3, [0, 1, 1], [1, 0, 2], True),
    (5, 100, 2, [1], [0], False),
    (9, 1500, 4, [1, 0], [0, 1], True),
    (0, 64, 2, [1], [0], True),
]


def make_row_inputs(T, D, S, kinds, entries, with_other, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(kinds)
    h = torch.randn(T, D, generator=g).to(dtype).to(device)
    other = torch.randn(T, D, generator=g).to(dtype).to(device) if with_other else None
    tok_slot = torch.randint(0, S, (T + 3,), generator=g, dtype=torch.int32).to(device)
    coef = torch.randn(S, E, generator=g)
    coef[0] = 0.0
    coef[coef.abs() < 0.3] = 0.0
    vec = torch.randn(E, D, generator=g)
    vec = vec / vec.norm(dim=1, keepdim=True)
    values = (torch.randn(E, generator=g) * 2).tolist()
    return h, other, tok_slot, coef.to(device), entries, kinds, values, vec.to(device)


def row_definition(h, other, tok_slot, coef, entries, kinds, values, vec):
    out = h.clone().float()
    oth = other.float() if other is not None else torch.zeros_like(out)
    for t in range(h.shape[0]):
        for e in entries:
            c = float(coef[int(tok_slot[t]), e])
            if c == 0.0:
                continue
            if kinds[e] == 1:
                x = out[t] + oth[t]
                out[t] = out[t] + c * (values[e] - float(x @ vec[e])) * vec[e]
            else:
                out[t] = out[t] + c * vec[e]
            out[t] = out[t].to(h.dtype).float()
    return out.to(h.dtype)


@pytest.mark.parametrize("case", ROW_CASES)
def test_row_reference_matches_definition(case):
    from vllm_xmix.kernels.row_write import row_write_reference

    args = make_row_inputs(*case, torch.float32, "cpu")
    h, other, tok_slot, coef, entries, kinds, values, vec = args
    want = row_definition(*args)
    got = h.clone()
    row_write_reference(got, other, tok_slot, coef, entries, kinds, values, vec)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    T = h.shape[0]
    inactive = ~(coef[tok_slot[:T].long()][:, entries] != 0).any(1)
    assert torch.equal(got[inactive], h[inactive])
    # ablation with c=1, value 0 leaves no component along r (when it is the only entry)
    if len(entries) == 1 and T:
        e = entries[0]
        on = coef[tok_slot[:T].long(), e] == 1.0
        if on.any():
            x = got[on] + (other[on] if other is not None else 0)
            torch.testing.assert_close(x @ vec[e], torch.full((int(on.sum()),), values[e]), rtol=1e-4, atol=1e-4)


def test_row_reference_with_gate_matches_masked_definition():
    """A per-token gate (mult) is the same as zeroing the coefficient for those tokens."""
    from vllm_xmix.kernels.row_write import row_write_reference

    for case in ROW_CASES:
        h, other, tok_slot, coef, entries, kinds, values, vec = make_row_inputs(*case, torch.float32, "cpu", seed=5)
        T = h.shape[0]
        g = torch.Generator().manual_seed(1)
        mult = (torch.rand(T, len(entries), generator=g) > 0.5).float()
        got = h.clone()
        row_write_reference(got, other, tok_slot, coef, entries, kinds, values, vec, mult=mult)
        want = h.clone()
        for t in range(T):  # one token at a time with its own coefficient table
            c = coef.clone()
            for i, e in enumerate(entries):
                c[int(tok_slot[t]), e] *= mult[t, i]
            row = want[t:t + 1].clone()
            row_write_reference(row, other[t:t + 1] if other is not None else None, tok_slot[t:t + 1], c, entries,
                                kinds, values, vec)
            want[t] = row[0]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _row_triton_check(device: str) -> None:
    from vllm_xmix.kernels.row_write import row_write_reference, row_write_triton

    for case in ROW_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            h, other, tok_slot, coef, entries, kinds, values, vec = make_row_inputs(*case, dtype, device, seed=7)
            want = h.clone()
            row_write_reference(want, other, tok_slot, coef, entries, kinds, values, vec)
            got = h.clone()
            dev = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
            row_write_triton(got, other, tok_slot, coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                             dev(values, torch.float32), vec, block_d=256)
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(got, want, **tol)
            T = h.shape[0]
            inactive = ~(coef[tok_slot[:T].long()][:, entries] != 0).any(1)
            assert torch.equal(got[inactive], h[inactive])
            # with a per-token gate
            mult = (torch.rand(T, len(entries), generator=torch.Generator().manual_seed(2)) > 0.5).float().to(device)
            want = h.clone()
            row_write_reference(want, other, tok_slot, coef, entries, kinds, values, vec, mult=mult)
            got = h.clone()
            row_write_triton(got, other, tok_slot, coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                             dev(values, torch.float32), vec, block_d=256, mult=mult)
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_triton_matches_reference_cuda():
    _row_triton_check("cuda")


def test_row_triton_matches_reference_interpreter():
    run_interpreted("_row_triton_check")


def _mask_check(device: str) -> None:
    """Router masks: -inf entries that are off for a token never turn it into NaN (both impls)."""
    from vllm_xmix.kernels.steer_add import steer_add_reference, steer_add_triton

    h = torch.randn(4, 4, device=device)
    vec = torch.tensor([[0.0, -math.inf, 0.0, 0.0, 9.0], [1.0, 2.0, 3.0, 4.0, 9.0]], device=device)  # wider table
    coef = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], device=device)
    tok = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device)
    ent = torch.tensor([0, 1], dtype=torch.int32, device=device)
    want = h.clone()
    want[1, 1] = -math.inf
    want[2] += 2.0 * vec[1, :4]
    want[3] += vec[1, :4]
    want[3, 1] = -math.inf
    for impl in (steer_add_reference, steer_add_triton):
        got = h.clone()
        impl(got, tok, coef, ent, vec)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)


def test_router_mask_reference():
    from vllm_xmix.kernels.steer_add import steer_add_reference

    h = torch.randn(2, 4)
    vec = torch.tensor([[0.0, -math.inf, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    coef = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    got = h.clone()
    steer_add_reference(got, torch.tensor([0, 1], dtype=torch.int32), coef, torch.tensor([0, 1], dtype=torch.int32), vec)
    assert not got.isnan().any()
    torch.testing.assert_close(got[1], h[1] + vec[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_mask_cuda():
    _mask_check("cuda")


def test_router_mask_interpreter():
    run_interpreted("_mask_check")


# ------------------------------------------------------------------ read_rows (probe / capture)

READ_CASES = [  # (T, D, S, kinds of all entries (2 probe, 3 capture, 4 cosine), site entries, with other)
    (6, 64, 3, [2, 3, 2, 4], [0, 1, 2, 3], True),
    (4, 300, 2, [4], [0], False),
    (5, 100, 2, [3], [0], False),
    (9, 1500, 4, [2, 0, 3], [2, 0], True),  # an entry of another kind in the table, not at this site
    (0, 64, 2, [2], [0], True),
]


def make_read_inputs(T, D, S, kinds, entries, with_other, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(kinds)
    h = torch.randn(T, D, generator=g).to(dtype)
    other = torch.randn(T, D, generator=g).to(dtype) if with_other else None
    tok_slot = torch.randint(0, S, (T + 3,), generator=g, dtype=torch.int32)
    coef = (torch.rand(S, E, generator=g) > 0.3).float()
    coef[0] = 0.0
    cols, c = [], 0
    for k in kinds:
        cols.append(c)
        c += D if k == 3 else 1
    flags = [i % 2 for i in range(E)]
    bias = torch.randn(E, generator=g).tolist()
    vec = torch.randn(E, D + 5, generator=g)  # the table may be wider than D
    out = torch.full((T + 2, c), 7.0)  # stale values: rows that are off must keep them
    mv = lambda x: None if x is None else x.to(device)  # noqa: E731
    return h.to(device), mv(other), tok_slot.to(device), coef.to(device), entries, kinds, cols, flags, bias, \
        vec.to(device), out.to(device)


def read_definition(h, other, tok_slot, coef, entries, kinds, cols, flags, bias, vec, out):
    """The semantics of kernels/read_rows.py as a plain loop."""
    out = out.clone()
    D = h.shape[1]
    for t in range(h.shape[0]):
        x = h[t].float() + (other[t].float() if other is not None else 0)
        for e in entries:
            if coef[int(tok_slot[t]), e] != 0:
                if kinds[e] == 2:
                    s = float(x @ vec[e, :D]) + bias[e]
                    out[t, cols[e]] = 1 / (1 + math.exp(-s)) if flags[e] else s
                elif kinds[e] == 4:
                    out[t, cols[e]] = float(x @ vec[e, :D]) / max(float(x.norm()), 1e-12)
                else:
                    out[t, cols[e]:cols[e] + D] = x
    return out


@pytest.mark.parametrize("case", READ_CASES)
def test_read_reference_matches_definition(case):
    from vllm_xmix.kernels.read_rows import read_rows_reference

    args = make_read_inputs(*case, torch.float32, "cpu")
    want = read_definition(*args)
    h, other, tok_slot, coef, entries, kinds, cols, flags, bias, vec, out = args
    read_rows_reference(h, other, tok_slot, coef, entries, kinds, cols, flags, bias, vec, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _read_triton_check(device: str) -> None:
    from vllm_xmix.kernels.read_rows import read_rows_reference, read_rows_triton

    for case in READ_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            h, other, tok_slot, coef, entries, kinds, cols, flags, bias, vec, out = make_read_inputs(
                *case, dtype, device, seed=3)
            want = out.clone()
            read_rows_reference(h, other, tok_slot, coef, entries, kinds, cols, flags, bias, vec, want)
            got = out.clone()
            dev = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
            read_rows_triton(h, other, tok_slot, coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                             dev(cols, torch.int32), dev(flags, torch.int32), dev(bias, torch.float32), vec, got)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
            assert (got[h.shape[0]:] == 7.0).all()  # rows past T untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_triton_matches_reference_cuda():
    _read_triton_check("cuda")


def test_read_triton_matches_reference_interpreter():
    run_interpreted("_read_triton_check")



# ------------------------------------------------------------------ request_mean (CAST decisions)


def make_mean_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, L, T = 5, 700, 9
    vals = torch.randn(S, L, generator=g)
    plen = torch.tensor([0, 3, 650, 1, 40], dtype=torch.int32)
    tok_slot = torch.tensor([1, 1, 2, 0, 3, 4, 4, 2, 1, 0, 0], dtype=torch.int32)
    tok_pos = torch.tensor([1, 2, 649, 0, 0, 38, 39, 5, 7, 0, 0], dtype=torch.int32)  # last prompt tokens: t=1,2,4,6
    mean = torch.full((S, 2), -7.0)
    return [x.to(device) for x in (vals, tok_slot, tok_pos, plen, mean)] + [T]


def test_request_mean_reference_matches_definition():
    from vllm_xmix.kernels.request_mean import request_mean_reference

    vals, tok_slot, tok_pos, plen, mean, T = make_mean_inputs("cpu")
    request_mean_reference(vals, tok_slot, tok_pos, plen, mean, 1, T)
    want = torch.full_like(mean, -7.0)
    for s in (1, 2, 3, 4):
        want[s, 1] = vals[s, : int(plen[s])].mean()
    torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-6)


def _mean_triton_check(device: str) -> None:
    from vllm_xmix.kernels.request_mean import request_mean_reference, request_mean_triton

    vals, tok_slot, tok_pos, plen, mean, T = make_mean_inputs(device)
    want = mean.clone()
    request_mean_reference(vals, tok_slot, tok_pos, plen, want, 0, T)
    got = mean.clone()
    request_mean_triton(vals, tok_slot, tok_pos, plen, got, 0, T, block=128)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_request_mean_triton_cuda():
    _mean_triton_check("cuda")


def test_request_mean_triton_interpreter():
    run_interpreted("_mean_triton_check")


# ------------------------------------------------------------------ conditions (cond_gate.py, request_mean store)


def make_cond_state(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, S, V, D = 12, 4, 50, 40
    tok_slot = torch.tensor([1, 1, 1, 0, 2, 2, 3, 3, 3, 0, 1, 2, 0, 0], dtype=torch.int32)
    tok_pos = torch.tensor([4, 5, 6, 0, 0, 1, 9, 10, 11, 0, 7, 2, 0, 0], dtype=torch.int32)
    slot_plen = torch.tensor([0, 6, 2, 12], dtype=torch.int32)
    tok_cur = torch.randint(0, V, (T + 2,), generator=g)
    tok_prev = torch.randint(-1, V, (T + 2,), generator=g)
    bitmaps = (torch.rand(2, V, generator=g) > 0.5).to(torch.int8)
    out = torch.randn(T + 2, 3, generator=g)
    req_mean = torch.randn(S, 2, generator=g)
    # latch positions (slot 1: from 5 on, slot 2: never, slot 3: from 10 on; latch 1: slot 1 from 0)
    latch_pos = torch.tensor([[2**31 - 1, 2**31 - 1], [5, 0], [2**31 - 1, 2**31 - 1], [10, 2**31 - 1]],
                             dtype=torch.int32)
    # entries: (ckind, cidx, op, gen, thr)
    cond_host = [(0, 0, 0, 0, 0.0), (1, 0, 0, 0, 0.0), (2, 1, 0, 1, 0.0), (3, 2, 1, 0, 0.1), (4, 1, 2, 0, 0.3),
                 (1, 1, 0, 1, 0.0), (3, 0, 3, 1, -0.2), (5, 0, 0, 0, 0.0), (5, 1, 0, 1, 0.0)]
    E = len(cond_host)
    coef = torch.randn(S, E, generator=g)
    coef[0] = 0
    entries = [6, 0, 1, 2, 7, 3, 4, 5, 8]
    kinds = [0, 1, 0, 1, 0, 0, 1, 0, 1]
    values = torch.randn(E, generator=g).tolist()
    vec = torch.nn.functional.normalize(torch.randn(E, D, generator=g), dim=1)
    h = torch.randn(T, D, generator=g)
    other = torch.randn(T, D, generator=g)
    mv = lambda x: x.to(device)  # noqa: E731
    st = dict(tok_slot=mv(tok_slot), tok_pos=mv(tok_pos), slot_plen=mv(slot_plen), tok_cur=mv(tok_cur),
              tok_prev=mv(tok_prev), bitmaps=mv(bitmaps), out=mv(out), req_mean=mv(req_mean),
              latch_pos=mv(latch_pos))
    return T, st, cond_host, mv(coef), entries, kinds, values, mv(vec), mv(h), mv(other)


def test_gate_reference_matches_definition():
    from vllm_xmix.kernels.cond_gate import gate_reference

    T, st, cond_host, coef, entries, kinds, values, vec, h, other = make_cond_state("cpu")
    got = gate_reference(T, entries, cond_host, st["tok_slot"], st["tok_pos"], st["slot_plen"], st["tok_cur"],
                         st["tok_prev"], st["bitmaps"], st["out"], st["req_mean"], st["latch_pos"])
    ops = [lambda a, b: a > b, lambda a, b: a >= b, lambda a, b: a < b, lambda a, b: a <= b]
    for t in range(T):
        s, pos = int(st["tok_slot"][t]), int(st["tok_pos"][t])
        P = int(st["slot_plen"][s])
        for i, e in enumerate(entries):
            ck, idx, op, gen, thr = cond_host[e]
            want = True
            if ck == 1:
                want = bool(st["bitmaps"][idx, int(st["tok_cur"][t])])
            elif ck == 2:
                p = int(st["tok_prev"][t])
                want = p >= 0 and bool(st["bitmaps"][idx, p])
            elif ck == 3:
                want = ops[op](float(st["out"][t, idx]), thr)
            elif ck == 4:
                want = ops[op](float(st["req_mean"][s, idx]), thr) and pos >= P - 1
            elif ck == 5:
                want = pos >= int(st["latch_pos"][s, idx])
            if ck and gen:
                want = want and pos >= P
            assert float(got[t, i]) == float(want), (t, e)


def _cond_triton_check(device: str) -> None:
    """The row kernel with conditions evaluated inline == reference gate + row_write_reference;
    note_tokens and the request-value store: Triton == torch."""
    from vllm_xmix.kernels import request_mean as rm
    from vllm_xmix.kernels.cond_gate import gate_reference, note_tokens_reference, note_tokens_triton
    from vllm_xmix.kernels.row_write import row_write_reference, row_write_triton

    T, st, cond_host, coef, entries, kinds, values, vec, h, other = make_cond_state(device, seed=4)
    mult = gate_reference(T, entries, cond_host, st["tok_slot"], st["tok_pos"], st["slot_plen"], st["tok_cur"],
                          st["tok_prev"], st["bitmaps"], st["out"], st["req_mean"], st["latch_pos"])
    want = h.clone()
    row_write_reference(want, other, st["tok_slot"], coef, entries, kinds, values, vec, mult=mult)
    got = h.clone()
    dev = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    cond = dict(st, cond_i=dev([list(c[:4]) for c in cond_host], torch.int32),
                cond_thr=dev([c[4] for c in cond_host], torch.float32))
    row_write_triton(got, other, st["tok_slot"], coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                     dev(values, torch.float32), vec, block_d=32, cond=cond)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(mult, torch.ones_like(mult)) and mult.any()  # the case gates some, not all

    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 50, (T,), generator=g).to(device)
    hist0 = torch.randint(0, 50, (4, 16), generator=g, dtype=torch.int32).to(device)
    # a step holds each request's tokens as one run in position order (vLLM's layout): the state's
    # later tokens of slots 1 and 2 (t = 10, 11) would read history their slot's earlier run writes
    # in the same launch, which CUDA programs order arbitrarily; here they belong to no request
    tok_slot = st["tok_slot"].clone()
    tok_slot[10:12] = 0
    res = []
    for impl in (note_tokens_reference, note_tokens_triton):
        hist, cur, prev = hist0.clone(), torch.zeros(T + 2, dtype=torch.int64, device=device), \
            torch.full((T + 2,), -5, dtype=torch.int64, device=device)
        impl(ids, tok_slot, st["tok_pos"], hist, cur, prev)
        res.append((hist, cur, prev))
    on = tok_slot[:T] != 0
    assert torch.equal(res[0][0][1:], res[1][0][1:])  # row 0 is the reference's trash row
    assert torch.equal(res[0][1][:T][on], res[1][1][:T][on]) and torch.equal(res[0][2][:T][on], res[1][2][:T][on])
    # token 1 follows token 0 of the same request: its previous token comes from this step
    assert int(res[1][2][1]) == int(ids[0]) and int(res[1][2][4]) == -1  # pos 0 has none

    vals0 = torch.randn(4, 16, generator=g).to(device)
    res = []
    for impl in (rm.store_values_reference, rm.store_values_triton):
        vals = vals0.clone()
        impl(vals, st["out"], 2, st["tok_slot"], st["tok_pos"], st["slot_plen"], coef, 3, T)
        res.append(vals)
    assert torch.equal(res[0][1:], res[1][1:]) and not torch.equal(res[1], vals0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cond_triton_cuda():
    _cond_triton_check("cuda")


def test_cond_triton_interpreter():
    run_interpreted("_cond_triton_check")


# ------------------------------------------------------------------ latch.py (cond(latch=...))


def make_latch_inputs(device, seed=0):
    """Two steps of tokens of three requests (slots 1-3; slot 1 in two chunks), four read entries
    (two of them latch 0 and 1 of the same read at two layers: both lower latch 0)."""
    g = torch.Generator().manual_seed(seed)
    T, S = 13, 5
    tok_slot = torch.tensor([1, 1, 1, 1, 0, 2, 2, 3, 3, 3, 3, 0, 2, 0, 0], dtype=torch.int32)
    tok_pos = torch.tensor([4, 5, 6, 7, 0, 0, 1, 20, 21, 22, 23, 0, 2, 0, 0], dtype=torch.int32)
    out = torch.randn(T + 2, 5, generator=g)
    E = 6
    coef = (torch.rand(S, E, generator=g) > 0.2).float()
    coef[0] = 0
    coef[3, 4] = 0  # slot 3 has entry 4 off
    # (latch index, comparison, threshold) per entry; entries 1, 4: no latch (-1)
    latch_host = [(0, 0, 0.2), (-1, 0, 0.0), (1, 3, -0.5), (0, 1, 0.9), (-1, 0, 0.0), (1, 2, 0.1)]
    cols = [0, 1, 2, 3, 4, 1]
    entries = [0, 2, 3, 5]
    latch_pos = torch.full((S, 2), 2**31 - 1, dtype=torch.int32)
    latch_pos[3, 0] = 21  # set by an earlier step: a later crossing does not raise it
    mv = lambda x: x.to(device)  # noqa: E731
    return T, mv(out), mv(tok_slot), mv(tok_pos), mv(coef), entries, latch_host, cols, mv(latch_pos)


def latch_definition(T, out, tok_slot, tok_pos, coef, entries, latch_host, cols, latch_pos):
    """The module docstring's plain loop."""
    ops = [lambda a, b: a > b, lambda a, b: a >= b, lambda a, b: a < b, lambda a, b: a <= b]
    want = latch_pos.clone()
    for t in range(T):
        s = int(tok_slot[t])
        for e in entries:
            k, op, thr = latch_host[e]
            v = torch.tensor([float(out[t, cols[e]])], dtype=torch.float32)
            if s != 0 and float(coef[s, e]) != 0 and bool(ops[op](v, thr)):
                want[s, k] = min(int(want[s, k]), int(tok_pos[t]))
    return want


def test_latch_reference_matches_definition():
    from vllm_xmix.kernels.latch import latch_set_reference

    for seed in range(4):
        T, out, tok_slot, tok_pos, coef, entries, latch_host, cols, latch_pos = make_latch_inputs("cpu", seed)
        want = latch_definition(T, out, tok_slot, tok_pos, coef, entries, latch_host, cols, latch_pos)
        got = latch_pos.clone()
        latch_set_reference(out, tok_slot, tok_pos, coef, entries, latch_host, cols, got, T)
        assert torch.equal(got, want), seed
        assert got[0].eq(2**31 - 1).all()  # the null slot never latches
    assert not torch.equal(got, latch_pos)  # the cases set some latches
    empty = latch_pos.clone()
    latch_set_reference(out, tok_slot, tok_pos, coef, entries, latch_host, cols, empty, 0)
    assert torch.equal(empty, latch_pos)


def _latch_triton_check(device: str) -> None:
    from vllm_xmix.kernels.latch import latch_set_reference, latch_set_triton

    for seed in range(3):
        T, out, tok_slot, tok_pos, coef, entries, latch_host, cols, latch_pos = make_latch_inputs(device, seed)
        want = latch_pos.clone()
        latch_set_reference(out, tok_slot, tok_pos, coef, entries, latch_host, cols, want, T)
        got = latch_pos.clone()
        dev = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        latch_set_triton(out, tok_slot, tok_pos, coef, dev(entries, torch.int32),
                         dev([[k, op] for k, op, _ in latch_host], torch.int32),
                         dev([thr for *_, thr in latch_host], torch.float32), dev(cols, torch.int32), got, T)
        assert torch.equal(got, want), (seed, got, want)
        assert not torch.equal(got, latch_pos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_latch_triton_cuda():
    _latch_triton_check("cuda")


def test_latch_triton_interpreter():
    run_interpreted("_latch_triton_check")


# ------------------------------------------------------------------ add_rms_norm (writes inside the norm)

NORM_CASES = [  # (T, D, S, kinds of all entries, site entries, row semantics)
    (6, 64, 3, [0, 0], [0, 1], False),  # two adds, one rounding
    (5, 100, 2, [0, 1, 1], [1, 0, 2], True),  # ablations and an add, in order
    (9, 1500, 4, [1, 0], [0, 1], True),
    (4, 4096, 3, [0], [0], False),
    (3, 64, 2, [0], [], False),  # the norm alone
    (0, 64, 2, [1], [0], True),
]


def norm_definition(x, residual, weight, eps, tok_slot, coef, entries, kinds, values, vec, row):
    """Row by row, from the semantics in kernels/add_rms_norm.py."""
    dt = x.dtype
    xo, ro = x.clone(), residual.clone()
    for t in range(x.shape[0]):
        h = residual[t].float()
        cs = [float(coef[int(tok_slot[t]), e]) for e in entries]
        if row:
            for e, c in zip(entries, cs):
                if c == 0.0:
                    continue
                coeff = c * (values[e] - float((h + x[t].float()) @ vec[e])) if kinds[e] == 1 else c
                h = (h + coeff * vec[e]).to(dt).float()
        elif any(cs):
            h = (h + sum(c * vec[e] for e, c in zip(entries, cs))).to(dt).float()
        z = (x[t].float() + h).to(dt).float()
        rs = 1.0 / math.sqrt(float((z * z).mean()) + eps)
        ro[t] = z.to(dt)
        xo[t] = ((z * rs).to(dt).float() * weight.float()).to(dt)
    return xo, ro


def make_norm_inputs(T, D, S, kinds, entries, row, dtype, device, seed=0):
    h, other, tok_slot, coef, entries, kinds, values, vec = make_row_inputs(T, D, S, kinds, entries, True, dtype,
                                                                            device, seed)
    weight = (1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(seed + 1))).to(dtype).to(device)
    return other, h, weight, 1e-5, tok_slot, coef, entries, kinds, values, vec, row


@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_reference_matches_definition(case):
    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_reference

    args = make_norm_inputs(*case, torch.float32, "cpu")
    x, residual = args[0], args[1]
    want_x, want_r = norm_definition(*args)
    gx, gr = x.clone(), residual.clone()
    add_rms_norm_reference(gx, gr, *args[2:])
    torch.testing.assert_close(gr, want_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, want_x, rtol=1e-5, atol=1e-5)
    # the rows with every entry off are vLLM's plain add + RMSNorm (the native IR op)
    from vllm import ir

    T = x.shape[0]
    if T and case[4]:
        off = ~(args[5][args[4][:T].long()][:, case[4]] != 0).any(1)
        px, pr = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), residual.clone(), args[2], args[3])
        torch.testing.assert_close(gx[off], px[off], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gr[off], pr[off], rtol=1e-6, atol=1e-6)


def _norm_triton_check(device: str) -> None:
    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_reference, add_rms_norm_triton

    for case in NORM_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x, r, w, eps, tok_slot, coef, entries, kinds, values, vec, row = make_norm_inputs(*case, dtype, device,
                                                                                              seed=9)
            wx, wr = x.clone(), r.clone()
            add_rms_norm_reference(wx, wr, w, eps, tok_slot, coef, entries, kinds, values, vec, row)
            gx, gr = x.clone(), r.clone()
            dev = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
            add_rms_norm_triton(gx, gr, w, eps, tok_slot, coef, dev(entries, torch.int32) if entries else None,
                                dev(kinds, torch.int32), dev(values, torch.float32), vec, row)
            # bf16: one rounding of the row's largest terms (|x| ~ 4: an ulp of 0.03) where an
            # ablation cancels them; the interpreter truncates where CUDA rounds to nearest
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=6.25e-2)
            torch.testing.assert_close(gr, wr, **tol)
            torch.testing.assert_close(gx, wx, **tol)
    x, r, w, eps, tok_slot, coef, entries, kinds, values, vec, row = make_norm_inputs(*NORM_CASES[0], torch.float32,
                                                                                      device)
    with pytest.raises(ValueError, match="need equal"):
        add_rms_norm_triton(x, r[:, :32], w, eps, tok_slot, coef, None, coef, coef, vec, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_triton_matches_reference_cuda():
    _norm_triton_check("cuda")


def test_norm_triton_matches_reference_interpreter():
    run_interpreted("_norm_triton_check")


def _norm_launch_check(device: str) -> None:
    """One ``AddRmsNormLaunch`` (a hosted norm's op keeps one per pair of site plans) launched
    again and again: on CUDA every launch after a specialization's first goes to the compiled
    kernel directly (kernels/launch.py), so these launches check that path: each equals the
    reference, for other x / residual tensors, other token counts, an x whose address is not
    16-byte aligned (another specialization) and back."""
    from vllm_xmix.kernels.add_rms_norm import AddRmsNormLaunch, add_rms_norm_reference

    dev = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    for case in NORM_CASES[:4]:
        for dtype in (torch.float32, torch.bfloat16):
            _, D, S, kinds_, ents, row = case
            x0, r0, w, eps, tok_slot, coef, entries, kinds, values, vec, row = make_norm_inputs(
                8, D, S, kinds_, ents, row, dtype, device, seed=3)
            launch = AddRmsNormLaunch(tok_slot, coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                                      dev(values, torch.float32), vec, row)
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=6.25e-2)
            for i, (T, misaligned) in enumerate([(8, False), (8, False), (5, False), (8, True), (3, True),
                                                 (8, False)]):
                g = torch.Generator().manual_seed(100 + i)
                x = (torch.randn(T, D, generator=g) * 2).to(dtype).to(device)
                r = (torch.randn(T, D, generator=g) * 2).to(dtype).to(device)
                if misaligned:  # the same values one element into a buffer: not 16-byte aligned
                    buf = torch.empty(T * D + 1, dtype=dtype, device=device)
                    buf[1:].copy_(x.reshape(-1))
                    x = buf[1:].view(T, D)
                    assert x.data_ptr() % 16 != 0
                wx, wr = x.clone(), r.clone()
                add_rms_norm_reference(wx, wr, w, eps, tok_slot, coef, entries, kinds, values, vec, row)
                launch(x, r, w, eps)
                torch.testing.assert_close(r, wr, **tol)
                torch.testing.assert_close(x, wx, **tol)


def _norm_launch_plans_check(device: str) -> None:
    """The hosted norm op's launches from site plans (``ops._norm_launch``, the op's path on
    CUDA): one site, two sites in one launch, and a site's writes alone then the norm alone
    equal the reference with the plans' entries; a launch is kept per pair of plan objects
    (the same plans: the same launch; a new plan object: a new one)."""
    from types import SimpleNamespace

    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_reference
    from vllm_xmix.ops import _norm_launch
    from vllm_xmix.runtime.variants import SitePlan

    x0, r0, w, eps, tok_slot, coef, _, kinds, values, vec, _ = make_norm_inputs(7, 100, 3, [0, 1, 1, 0], [], True,
                                                                                torch.float32, device, seed=5)
    idx = lambda v: torch.tensor(v, dtype=torch.int32, device=device) if v else None  # noqa: E731
    plan = lambda ents, row, pre=(): SitePlan(  # noqa: E731
        pre=idx(list(pre)), writes=idx(ents), writes_host=ents, row=row, has_cond=False, reads=None, reads_host=[],
        req_reads=[], latch_reads=[], latch_idx=None)
    lay = SimpleNamespace(tok_slot=tok_slot, coef=coef, kinds=torch.tensor(kinds, dtype=torch.int32, device=device),
                          values=torch.tensor(values, device=device), vectors=vec,
                          conditions=SimpleNamespace(cond_args=None))
    st = SimpleNamespace(layout=lay, norm_launches={})
    p, q = plan([1, 0, 2], True), plan([3], False, pre=[0])
    for pp, qq, norm, ref in [
            (p, None, True, dict(entries=[1, 0, 2], row=True)),
            (p, q, True, dict(entries=[1, 0, 2], row=True, second=([3], False, [0], None))),
            (q, None, False, dict(entries=[3], row=False, pre=[0], norm=False)),
            (None, None, True, dict(entries=[], row=False))]:
        for _ in range(2):  # (on CUDA the second launch is the compiled one)
            x, r, wx, wr = x0.clone(), r0.clone(), x0.clone(), r0.clone()
            add_rms_norm_reference(wx, wr, w, eps, tok_slot, coef, kinds=kinds, values=values, vectors=vec, **ref)
            _norm_launch(st, pp, qq, norm)(x, r, w, eps)
            torch.testing.assert_close(r, wr, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x, wx, rtol=1e-5, atol=1e-5)
    assert _norm_launch(st, p, q, True) is _norm_launch(st, p, q, True)
    p2 = plan([1, 0, 2], True)
    assert _norm_launch(st, p2, q, True) is not _norm_launch(st, p, q, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_launch_from_plans_matches_reference_cuda():
    _norm_launch_plans_check("cuda")


def test_norm_launch_from_plans_matches_reference_interpreter():
    run_interpreted("_norm_launch_plans_check")


def _app_free_norm_check(device: str) -> None:
    """A hosted norm none of whose sites is on in the step (``ops._app_free_norm``: the norm
    alone) gives each token, bit for bit, what a launch with a site on gives a token on the null
    slot, for adds, ablations in order, two sites, a site's adds beside its row writes, in float32
    and bfloat16: an app-off token's values do not depend on whether other requests' apps are on
    in its step. On CUDA through the op's own path (``_app_free_norm``, which on CPU runs vLLM's
    norm instead); under the interpreter through the launch it makes."""
    from types import SimpleNamespace

    from vllm_xmix.ops import _app_free_norm, _norm_launch
    from vllm_xmix.runtime.variants import SitePlan

    idx = lambda v: torch.tensor(v, dtype=torch.int32, device=device) if v else None  # noqa: E731
    plan = lambda ents, row, pre=(): SitePlan(  # noqa: E731
        pre=idx(list(pre)), writes=idx(ents), writes_host=ents, row=row, has_cond=False, reads=None, reads_host=[],
        req_reads=[], latch_reads=[], latch_idx=None)
    for dtype in (torch.float32, torch.bfloat16):
        x0, r0, w, eps, tok_slot, coef, _, kinds, values, vec, _ = make_norm_inputs(
            16, 300, 3, [0, 1, 1, 0], [], True, dtype, device, seed=11)
        lay = SimpleNamespace(tok_slot=tok_slot, coef=coef, kinds=torch.tensor(kinds, dtype=torch.int32, device=device),
                              values=torch.tensor(values, device=device), vectors=vec,
                              conditions=SimpleNamespace(cond_args=None))
        st = SimpleNamespace(layout=lay, norm_launches={})
        null = tok_slot[:16] == 0
        assert 0 < int(null.sum()) < 16  # both kinds of token in the step
        fx, fr = x0.clone(), r0.clone()
        if device == "cuda":
            _app_free_norm(st, fx, fr, w, eps)
        else:
            _norm_launch(st, None, None, True)(fx, fr, w, eps)
        for p, q in [(plan([0, 3], False), None), (plan([1, 0, 2], True), None),
                     (plan([1, 0, 2], True), plan([3], False, pre=[0])), (plan([2], True, pre=[3]), None)]:
            x, r = x0.clone(), r0.clone()
            _norm_launch(st, p, q, True)(x, r, w, eps)
            assert not torch.equal(r[~null], fr[~null])  # the writes reached the steered tokens
            assert torch.equal(r[null], fr[null]) and torch.equal(x[null], fx[null]), (dtype, p.writes_host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_app_free_norm_equals_a_null_slot_token_of_a_launch_with_writes_cuda():
    _app_free_norm_check("cuda")


def test_app_free_norm_equals_a_null_slot_token_of_a_launch_with_writes_interpreter():
    run_interpreted("_app_free_norm_check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_launch_again_matches_reference_cuda():
    _norm_launch_check("cuda")


def test_norm_launch_again_matches_reference_interpreter():
    run_interpreted("_norm_launch_check")


def test_norm_launch_args_follow_the_kernels_signature():
    """The argument tuple a launch passes (to the JIT, and to the compiled kernel, which takes
    the signature's every parameter in order, constexprs included) binds each parameter to the
    value it names."""
    import inspect

    from vllm_xmix.kernels.add_rms_norm import _add_rms_norm_kernel, AddRmsNormLaunch

    x, r, w, eps, tok_slot, coef, entries, kinds, values, vec, row = make_norm_inputs(*NORM_CASES[1], torch.float32,
                                                                                      "cpu")
    ents, kt, vt, pre = (torch.tensor(entries, dtype=torch.int32), torch.tensor(kinds, dtype=torch.int32),
                         torch.tensor(values), torch.tensor([0], dtype=torch.int32))
    cond = {k: torch.zeros(4, dtype=torch.int32) for k in ("cond_i", "tok_pos", "slot_plen", "tok_cur", "tok_prev")}
    cond.update(cond_thr=torch.zeros(4), bitmaps=torch.zeros(3, 7, dtype=torch.int32), out=torch.zeros(9, 5),
                req_mean=torch.zeros(6, 2), latch_pos=torch.zeros(3, 11, dtype=torch.int32))
    second = (torch.tensor([1, 2], dtype=torch.int32), False, None, False)
    launch = AddRmsNormLaunch(tok_slot, coef, ents, kt, vt, vec, True, pre=pre, cond=cond, gated=True, second=second,
                              norm=False)
    got = inspect.signature(_add_rms_norm_kernel.fn).bind(*launch.args(x, r, w, eps)).arguments
    want = dict(x_ptr=x, stride_x=x.stride(0), r_ptr=r, stride_r=r.stride(0), w_ptr=w, tok_slot_ptr=tok_slot,
                coef_ptr=coef, stride_coef=coef.stride(0), kinds_ptr=kt, values_ptr=vt, vec_ptr=vec,
                stride_vec=vec.stride(0), D=x.shape[1], eps=eps, entries_ptr=ents, n_entries=len(entries),
                pre_ptr=pre, n_pre=1, entries2_ptr=second[0], n_entries2=2, pre2_ptr=tok_slot, n_pre2=0,
                cond_i_ptr=cond["cond_i"], cond_thr_ptr=cond["cond_thr"], tok_pos_ptr=cond["tok_pos"],
                plen_ptr=cond["slot_plen"], tok_cur_ptr=cond["tok_cur"], tok_prev_ptr=cond["tok_prev"],
                bitmap_ptr=cond["bitmaps"], V=7, out_ptr=cond["out"], stride_out=5, mean_ptr=cond["req_mean"],
                stride_mean=2, latch_ptr=cond["latch_pos"], stride_latch=11, ROW=True, HAS_PRE=True, HAS_COND=True,
                TWO=True, ROW2=False, HAS_PRE2=False, HAS_COND2=False, NORM=False, BLOCK_D=128)
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k] is v if isinstance(v, torch.Tensor) else got[k] == v, k
    # the compiled launch's: the same, each tensor as its address
    assert launch.ptr_args(x, r, w, eps) == tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v
                                                  for v in want.values())


def test_compiled_launch_is_off_only_while_a_launch_hook_is_registered():
    """Triton 3.6 keeps its launch hooks as (empty) hook chains: an empty chain must not turn the
    compiled launch off (it did: every launch then went through the JIT), a registered hook must
    (only the JIT hands hooks the launch metadata)."""
    knobs = pytest.importorskip("triton.knobs")
    from vllm_xmix.kernels.launch import _launch_hooks

    assert _launch_hooks() is None
    rt = knobs.runtime

    def hook(*args, **kwargs):
        return None

    if hasattr(rt.launch_enter_hook, "add"):
        rt.launch_enter_hook.add(hook)
        try:
            assert _launch_hooks() is not None
        finally:
            rt.launch_enter_hook.remove(hook)
    else:
        old, rt.launch_enter_hook = rt.launch_enter_hook, hook
        try:
            assert _launch_hooks() is not None
        finally:
            rt.launch_enter_hook = old
    assert _launch_hooks() is None


def test_norm_launch_key_determines_tritons_specialization():
    """Launches with equal keys must be launches Triton specializes alike (the compiled kernel of
    the first is reused for the rest): Triton's own binder (its per-launch specialization of
    every argument, and the launch options, under the installed Triton) gives equal results
    wherever the launch's key is equal, over token counts, dtypes, aligned and unaligned
    tensors, strides, other weights and the launch's warps; the inputs cover several
    specializations, so the key has to tell them apart."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import BaseBackend

    from vllm_xmix.kernels.add_rms_norm import _add_rms_norm_kernel, AddRmsNormLaunch

    K = _add_rms_norm_kernel
    binder = triton_jit.create_function_from_signature(K.signature, K.params, BaseBackend)
    _, D, S, kinds_, ents, row = NORM_CASES[1]
    _, _, w, eps, tok_slot, coef, entries, kinds, values, vec, row = make_norm_inputs(4, D, S, kinds_, ents, row,
                                                                                      torch.float32, "cpu")
    seen: dict = {}
    specs = set()
    for warps in (None, 8):
        launch = AddRmsNormLaunch(tok_slot, coef, torch.tensor(entries, dtype=torch.int32),
                                  torch.tensor(kinds, dtype=torch.int32), torch.tensor(values), vec, row,
                                  num_warps=warps)
        for dtype in (torch.float32, torch.bfloat16):
            wt = w.to(dtype)
            wbuf = torch.empty(D + 1, dtype=dtype)
            for T in (1, 2, 16, 17):
                for x_off, r_off, wmis, xpad, rpad in [(0, 0, False, 0, 0), (1, 0, False, 0, 0), (0, 1, False, 0, 0),
                                                       (0, 0, True, 0, 0), (1, 1, True, 0, 0), (0, 0, False, 12, 0),
                                                       (0, 0, False, 0, 12), (0, 0, False, 3, 3)]:  # 112: 16 | stride
                    xb = torch.zeros(T * (D + xpad) + 1, dtype=dtype)
                    rb = torch.zeros(T * (D + rpad) + 1, dtype=dtype)
                    x = xb[x_off:x_off + T * (D + xpad)].view(T, D + xpad)[:, :D]
                    r = rb[r_off:r_off + T * (D + rpad)].view(T, D + rpad)[:, :D]
                    ww = wbuf[1:] if wmis else wt
                    key = launch.key(x, r, ww)
                    _, spec, options = binder(*launch.args(x, r, ww, eps), num_warps=launch.num_warps(D))
                    spec = (tuple(spec), options.get("num_warps"))
                    specs.add(spec)
                    assert seen.setdefault(key, spec) == spec, (warps, dtype, T, x_off, r_off, wmis, xpad, rpad)
    assert len(specs) >= 16


def test_compiled_launch_key_determines_tritons_specialization():
    """The generic key of ``CompiledLaunch`` (the add, row, read and condition kernels): equal keys
    only for launches Triton's binder specializes alike (the add kernel here, over dtypes,
    alignment, strides and entry counts), and a key that tells ``True``, ``1`` and ``1.0`` apart
    (equal in Python, a bool, a constexpr 1 and a float to Triton)."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import BaseBackend

    from vllm_xmix.kernels.launch import CompiledLaunch
    from vllm_xmix.kernels.steer_add import _steer_add_kernel as K

    binder = triton_jit.create_function_from_signature(K.signature, K.params, BaseBackend)
    seen: dict = {}
    specs = set()
    tok_slot, coef = torch.zeros(20, dtype=torch.int32), torch.zeros(4, 3)
    for dtype in (torch.float32, torch.bfloat16):
        for off, pad, n_ent in [(0, 0, 1), (1, 0, 1), (0, 12, 1), (0, 3, 2), (1, 12, 16), (0, 0, 16)]:
            D = 100
            buf = torch.zeros(5 * (D + pad) + 1, dtype=dtype)
            h = buf[off:off + 5 * (D + pad)].view(5, D + pad)[:, :D]
            ents = torch.zeros(n_ent, dtype=torch.int32)
            vec = torch.zeros(3, D + pad)
            args = (h, h.stride(0), tok_slot, coef, coef.stride(0), ents, vec, vec.stride(0), ents.shape[0], D, 128)
            key, ptrs = CompiledLaunch.key_and_pointers(args, None)
            assert ptrs == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
            spec = tuple(binder(*args)[1])
            specs.add(spec)
            assert seen.setdefault(key, spec) == spec, (dtype, off, pad, n_ent)
    assert len(specs) >= 6
    keys = {CompiledLaunch.key_and_pointers((v,), None)[0] for v in (True, 1, 1.0)}
    assert len(keys) == 3


def test_plain_norm_on_cpu_is_vllms_compiled_kernel():
    """A hosted norm with nothing to write (apps off) is vLLM's own fused add + RMSNorm: on a CPU
    build that has the compiled kernel, that kernel (the same bits), not the native formula of
    five unfused torch ops (a different rounding here), which Inductor would have fused in plain
    vLLM; both within float32 rounding of the definition."""
    import vllm._custom_ops  # noqa: F401
    from vllm import ir

    from vllm_xmix.ops import plain_add_rms_norm

    if not torch.ops._C.fused_add_rms_norm.default.has_kernel_for_dispatch_key("CPU"):
        pytest.skip("this vLLM build has no CPU kernel for fused_add_rms_norm")
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(33, 256, generator=g), torch.randn(33, 256, generator=g)
    w = 1 + 0.1 * torch.randn(256, generator=g)
    ours, ours_r = x.clone(), r.clone()
    plain_add_rms_norm(ours, ours_r, w, 1e-5)
    kx, kr = x.clone(), r.clone()
    torch.ops._C.fused_add_rms_norm(kx, kr, w, 1e-5)
    nx, nr = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), r.clone(), w, 1e-5)
    assert not torch.equal(kx, nx), "inputs where the two implementations round differently"
    assert torch.equal(ours, kx) and torch.equal(ours_r, kr)
    s = x.double() + r.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_r, x + r)


def _norm_cond_inputs(device, dtype, seed=4):
    """A site with two unconditional adds applied first (``pre``) and conditional writes of every
    condition kind (make_cond_state), before the norm."""
    T, st, cond_host, coef, entries, kinds, values, vec, h, other = make_cond_state(device, seed=seed)
    w = (1 + 0.1 * torch.randn(h.shape[1], generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)
    mult = gate_of(T, entries, cond_host, st)
    return T, st, cond_host, coef, [0, 2], entries, kinds, values, vec, other.to(dtype), h.to(dtype), w, mult


def gate_of(T, entries, cond_host, st):
    from vllm_xmix.kernels.cond_gate import gate_reference

    return gate_reference(T, entries, cond_host, st["tok_slot"], st["tok_pos"], st["slot_plen"], st["tok_cur"],
                          st["tok_prev"], st["bitmaps"], st["out"], st["req_mean"], st["latch_pos"])


def test_norm_reference_with_adds_first_and_gates_matches_definition():
    """``pre`` adds (one float32 sum, rounded once), then the gated entries in order (each
    rounded), then vLLM's add + RMSNorm: row by row, from the module docstring."""
    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_reference

    T, st, cond_host, coef, pre, entries, kinds, values, vec, x, r, w, mult = _norm_cond_inputs("cpu", torch.float32)
    assert mult.any() and not mult.all()  # some tokens gated off, some on
    eps = 1e-5
    gx, gr = x.clone(), r.clone()
    add_rms_norm_reference(gx, gr, w, eps, st["tok_slot"], coef, entries, kinds, values, vec, True, pre=pre, mult=mult)
    for t in range(T):
        s = int(st["tok_slot"][t])
        h = r[t].float()
        cs = [float(coef[s, e]) for e in pre]
        if any(cs):
            h = h + sum(c * vec[e] for e, c in zip(pre, cs))
        for i, e in enumerate(entries):
            c = float(coef[s, e]) * float(mult[t, i])
            if c != 0.0:
                h = h + (c * (values[e] - float((h + x[t].float()) @ vec[e])) if kinds[e] == 1 else c) * vec[e]
        z = x[t].float() + h
        want_x = z / math.sqrt(float((z * z).mean()) + eps) * w.float()
        torch.testing.assert_close(gr[t], z, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx[t], want_x, rtol=1e-5, atol=1e-5)


def _norm_cond_triton_check(device: str) -> None:
    """The norm kernel with ``pre`` adds and conditions evaluated inline == the torch reference
    with the reference gate, float32 and bfloat16, for one site and for two sites at one norm
    (in order); gated writes without row semantics or without the condition tensors are refused."""
    from vllm_xmix.kernels.add_rms_norm import add_rms_norm_reference, add_rms_norm_triton

    dev = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        T, st, cond_host, coef, pre, entries, kinds, values, vec, x, r, w, mult = _norm_cond_inputs(device, dtype)
        cond = dict(st, cond_i=dev([list(c[:4]) for c in cond_host], torch.int32),
                    cond_thr=dev([c[4] for c in cond_host], torch.float32))
        for use_pre in (pre, []):
            wx, wr = x[:T].clone(), r[:T].clone()
            add_rms_norm_reference(wx, wr, w, 1e-5, st["tok_slot"], coef, entries, kinds, values, vec, True,
                                   pre=use_pre, mult=mult)
            gx, gr = x[:T].clone(), r[:T].clone()
            add_rms_norm_triton(gx, gr, w, 1e-5, st["tok_slot"], coef, dev(entries, torch.int32),
                                dev(kinds, torch.int32), dev(values, torch.float32), vec, True,
                                pre=dev(use_pre, torch.int32) if use_pre else None, cond=cond)
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=6.25e-2)
            torch.testing.assert_close(gr, wr, **tol)
            torch.testing.assert_close(gx, wx, **tol)
        # two sites at one norm: ungated adds/ablations (first), then gated writes after adds (second)
        first = [1, 3, 0]  # kinds PROJ, PROJ, ADD
        gates = gate_of(T, entries, cond_host, st)
        for row_a in (True, False):
            ents_a = first if row_a else [0, 2]  # (add semantics: adds only)
            wx, wr = x[:T].clone(), r[:T].clone()
            add_rms_norm_reference(wx, wr, w, 1e-5, st["tok_slot"], coef, ents_a, kinds, values, vec, row_a,
                                   second=(entries, True, pre, gates))
            gx, gr = x[:T].clone(), r[:T].clone()
            add_rms_norm_triton(gx, gr, w, 1e-5, st["tok_slot"], coef, dev(ents_a, torch.int32),
                                dev(kinds, torch.int32), dev(values, torch.float32), vec, row_a, cond=cond, gated=False,
                                second=(dev(entries, torch.int32), True, dev(pre, torch.int32), True))
            torch.testing.assert_close(gr, wr, **tol)
            torch.testing.assert_close(gx, wx, **tol)
            # each site's writes alone, then the norm alone (ops.hook_norm_ when the first site
            # has reads): bit for bit the one-kernel result, x untouched until the norm
            sx, sr = x[:T].clone(), r[:T].clone()
            for ents, rw, pr, g in ((ents_a, row_a, None, False), (entries, True, pre, True)):
                add_rms_norm_triton(sx, sr, w, 1e-5, st["tok_slot"], coef, dev(ents, torch.int32),
                                    dev(kinds, torch.int32), dev(values, torch.float32), vec, rw, cond=cond,
                                    gated=g, pre=dev(pr, torch.int32) if pr else None, norm=False)
                assert torch.equal(sx, x[:T])
            wx2, wr2 = x[:T].clone(), r[:T].clone()
            add_rms_norm_reference(wx2, wr2, w, 1e-5, st["tok_slot"], coef, ents_a, kinds, values, vec, row_a,
                                   second=(entries, True, pre, gates), norm=False)
            torch.testing.assert_close(sr, wr2, **tol)
            add_rms_norm_triton(sx, sr, w, 1e-5, st["tok_slot"], coef, None, dev(kinds, torch.int32),
                                dev(values, torch.float32), vec, False)
            assert torch.equal(sr, gr) and torch.equal(sx, gx)
            # the order matters: the second site's projections see the first site's writes
            ox, orr = x[:T].clone(), r[:T].clone()
            add_rms_norm_reference(ox, orr, w, 1e-5, st["tok_slot"], coef, entries, kinds, values, vec, True,
                                   pre=pre, mult=gates, second=(ents_a, row_a, None, None))
            assert not torch.allclose(orr, wr, rtol=1e-3, atol=1e-3)
            # the gated site first: Triton == reference in that order too
            tx, tr = x[:T].clone(), r[:T].clone()
            add_rms_norm_triton(tx, tr, w, 1e-5, st["tok_slot"], coef, dev(entries, torch.int32),
                                dev(kinds, torch.int32), dev(values, torch.float32), vec, True,
                                pre=dev(pre, torch.int32), cond=cond, gated=True,
                                second=(dev(ents_a, torch.int32), row_a, None, False))
            torch.testing.assert_close(tr, orr, **tol)
            torch.testing.assert_close(tx, ox, **tol)
    with pytest.raises(ValueError, match="row semantics"):
        add_rms_norm_triton(gx, gr, w, 1e-5, st["tok_slot"], coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                            dev(values, torch.float32), vec, False, cond=cond)
    with pytest.raises(ValueError, match="condition tensors"):
        add_rms_norm_triton(gx, gr, w, 1e-5, st["tok_slot"], coef, dev(entries, torch.int32), dev(kinds, torch.int32),
                            dev(values, torch.float32), vec, True,
                            second=(dev(entries, torch.int32), True, None, True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_cond_triton_matches_reference_cuda():
    _norm_cond_triton_check("cuda")


def test_norm_cond_triton_matches_reference_interpreter():
    run_interpreted("_norm_cond_triton_check")
