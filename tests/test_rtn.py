"""RTN and the shared grid helpers, against a plain per-group loop written here."""

import pytest
import torch

from quantspec.errors import QuantspecError
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import QuantScheme


def slow_rtn(w, scheme):
    n, k = w.shape
    g = scheme.group_len(k)
    deq = torch.empty_like(w)
    for lo in range(0, k, g):
        blk = w[:, lo:lo + g]
        for i in range(n):
            row = blk[i]
            lo_v, hi_v = min(row.min().item(), 0.0), max(row.max().item(), 0.0)
            if scheme.symmetric:
                s = 2 * max(abs(lo_v), hi_v) / scheme.maxq
                s = s if s > 0 else 1.0
                s = float(torch.tensor(s).half())
                z = scheme.sym_zero
            else:
                s = (hi_v - lo_v) / scheme.maxq
                if s > 0 and round(-lo_v / s) < 1:  # zero points stay >= 1
                    s = hi_v / (scheme.maxq - 1)
                s = s if s > 0 else 1.0
                s = float(torch.tensor(s).half())
                z = min(max(round(-lo_v / s), 1), scheme.maxq)
            q = torch.clamp(torch.round(row / s) + z, 0, scheme.maxq)
            deq[i, lo:lo + g] = (q - z) * s
    return deq


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [-1, 32, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_matches_slow_loop(bits, group, sym):
    torch.manual_seed(bits * 7 + group)
    w = torch.randn(6, 160) * 0.05
    w[0] = 0.0  # an all-zero row must not divide by zero
    w[1] = w[1].abs()  # no negative weight: the zero point must still be >= 1
    scheme = QuantScheme(bits=bits, group_size=group, symmetric=sym)
    r = rtn(w, scheme)
    r.validate()
    if not sym:
        assert int(r.zeros.min()) >= 1
    assert torch.allclose(r.dequantize(), slow_rtn(w, scheme), atol=1e-6)
    # error bound: one step per element (half a step of rounding, plus clamping at the top code
    # for symmetric grids or the rounded zero point for asymmetric ones)
    step = r.scales.float()[:, r.group_index()]
    assert ((r.dequantize() - w).abs() <= step + 1e-7).all()


def test_partial_last_group():
    w = torch.randn(4, 96)
    r = rtn(w, QuantScheme(bits=4, group_size=64))
    assert r.scales.shape == (4, 2)
    assert torch.allclose(r.dequantize(), slow_rtn(w, QuantScheme(bits=4, group_size=64)), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"bits": 5}, "bits=5"),
        ({"group_size": 100}, "group_size=100"),
        ({"bits": 4, "activations": "int8-token-dynamic"}, "W8A8"),
        ({"static_groups": True}, "act_order"),
    ],
)
def test_bad_schemes_explain_themselves(kwargs, needle):
    with pytest.raises(QuantspecError, match=needle):
        QuantScheme(**kwargs)
