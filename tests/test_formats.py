"""Checkpoint formats: exact round trips, published bit layouts, loaders' dequantization,
cannot_hold rules, config parsing, and a cross-check against compressed-tensors itself.

Every comparison of integer tensors is exact; dequantized weights are compared exactly too
(same fp32 arithmetic on the same codes, scales and zeros).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from quantspec.errors import QuantspecError
from quantspec.formats import (
    FORMAT_NAMES,
    AWQFormat,
    CompressedTensorsFormat,
    GPTQFormat,
    get_format,
    read_quantization_config,
)
from quantspec.formats.bitpack import pack_int32, unpack_int32
from quantspec.core.scheme import QuantResult, QuantScheme

NS = (24, 40, 64)
KS = (96, 320, 384)
GROUPS = (-1, 32, 128)
ORDERS = ("none", "permuted", "static")


def u32(x: int) -> int:
    """The int32 value of a 32-bit pattern written in hex."""
    return x - (1 << 32) if x >= 1 << 31 else x


def make_scheme(bits, group, sym, order, activations=None) -> QuantScheme:
    return QuantScheme(
        bits=bits,
        group_size=group,
        symmetric=sym,
        act_order=order != "none",
        static_groups=order == "static",
        activations=activations,
    )


def random_result(scheme: QuantScheme, n: int, k: int, gen: torch.Generator, min_zero: int = 0):
    """Codes over the whole range, random fp16 scales, zeros in [min_zero, maxq], and for
    act-order a g_idx from a random column permutation (column perm[i] is the i-th
    processed, in group i // group_len)."""
    g = scheme.num_groups(k)
    q = torch.randint(0, scheme.maxq + 1, (n, k), generator=gen).to(torch.uint8)
    scales = (torch.rand(n, g, generator=gen) * 0.1 + 1e-3).to(torch.float16)
    zeros = None
    if not scheme.symmetric:
        zeros = torch.randint(min_zero, scheme.maxq + 1, (n, g), generator=gen).to(torch.uint8)
    g_idx = None
    if scheme.act_order and not scheme.static_groups:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // scheme.group_len(k)).to(torch.int32)
    r = QuantResult(q, scales, zeros, g_idx, scheme)
    r.validate()
    return r


def bitstream_pack(values: list[int], bits: int) -> list[int]:
    """Independent oracle: an LSB-first bit string cut into 32-bit words (as int32)."""
    s = "".join(format(v, f"0{bits}b")[::-1] for v in values)
    s += "0" * (-len(s) % 32)
    return [u32(int(s[i : i + 32][::-1], 2)) for i in range(0, len(s), 32)]


# ---------------------------------------------------------------------------------------
# exact round trips on odd shapes, tensor_specs == what pack returns

CASES = [
    ("gptq", 2), ("gptq", 3), ("gptq", 4), ("gptq", 8),
    ("awq", 4),
    ("compressed-tensors", 2), ("compressed-tensors", 3),
    ("compressed-tensors", 4), ("compressed-tensors", 8),
]


@pytest.mark.parametrize("name,bits", CASES)
def test_round_trip_exact(name, bits):
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(bits * 7 + len(name))
    held = set()
    for sym, group, order, n, k in itertools.product((True, False), GROUPS, ORDERS, NS, KS):
        scheme = make_scheme(bits, group, sym, order)
        if fmt.cannot_hold(scheme, n, k):
            continue
        held.add((sym, group, order))
        # GPTQ v1 cannot store a zero of 0 (see test_gptq_v1_refuses_zero_point_0)
        r = random_result(scheme, n, k, gen, min_zero=1 if name == "gptq" else 0)
        packed = fmt.pack(r)
        specs = fmt.tensor_specs(scheme, n, k)
        assert {t: (tuple(v.shape), v.dtype) for t, v in packed.items()} == specs, (scheme, n, k)
        back = fmt.unpack(packed, scheme, n, k)
        assert back.equal(r), (name, scheme, n, k)
    # every scheme variant was exercised on at least one shape (AWQ has no act-order g_idx)
    expected = {
        c for c in itertools.product((True, False), GROUPS, ORDERS)
        if not (name == "awq" and c[2] == "permuted")
    }
    assert held == expected, expected - held


def test_round_trip_w8a8_int_quantized():
    fmt = CompressedTensorsFormat()
    gen = torch.Generator().manual_seed(0)
    scheme = QuantScheme(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")
    for n, k in ((24, 96), (40, 100), (7, 13)):
        assert fmt.cannot_hold(scheme, n, k) is None
        r = random_result(scheme, n, k, gen)
        packed = fmt.pack(r)
        assert packed["weight"].dtype == torch.int8
        assert torch.equal(packed["weight"].to(torch.int16), r.qweight.to(torch.int16) - 128)
        assert {t: (tuple(v.shape), v.dtype) for t, v in packed.items()} == fmt.tensor_specs(scheme, n, k)
        assert fmt.unpack(packed, scheme, n, k).equal(r)


def test_gptq_v2_round_trip_keeps_zero_0():
    fmt = GPTQFormat("gptq_v2")
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    r = random_result(scheme, 24, 96, torch.Generator().manual_seed(1))
    r.zeros[0, 0] = 0
    packed = fmt.pack(r)
    assert fmt.unpack(packed, scheme, 24, 96).equal(r)
    # v2 stores zeros as they are: nibble 0 of word 0 is the zero of (group 0, column 0)
    assert int(packed["qzeros"][0, 0]) & 0xF == 0


def test_bf16_scales_survive():
    fmt = GPTQFormat()
    scheme = QuantScheme(bits=4, group_size=32)
    r = random_result(scheme, 24, 96, torch.Generator().manual_seed(2))
    r.scales = r.scales.to(torch.bfloat16)
    assert fmt.unpack(fmt.pack(r), scheme, 24, 96).equal(r)


# ---------------------------------------------------------------------------------------
# the published bit layouts, on hand-worked examples


def test_bitpack_matches_independent_bitstream():
    gen = torch.Generator().manual_seed(3)
    for bits, length in itertools.product(range(1, 9), (1, 31, 32, 33, 96, 100)):
        codes = torch.randint(0, 1 << bits, (3, length), generator=gen).to(torch.uint8)
        packed = pack_int32(codes, bits)
        for row in range(3):
            assert packed[row].tolist() == bitstream_pack(codes[row].tolist(), bits), (bits, length)
        assert torch.equal(unpack_int32(packed, bits, length), codes)


def test_gptq_3bit_straddles_words_like_autogptq():
    # AutoGPTQ's 3-bit pack: rows 0-9 in word 0 bits 0-29; row 10's low 2 bits in bits 30-31,
    # its high bit in bit 0 of word 1; rows 11-20 from bit 1; row 21 split 1|2; rows 22-31.
    rows = [5] * 32  # 0b101
    rows[10] = 0b110
    rows[21] = 0b011
    scheme = QuantScheme(bits=3, group_size=32, symmetric=True)
    q = torch.tensor(rows, dtype=torch.uint8).repeat(32, 1)  # N=32 columns, K=32 rows
    r = QuantResult(q, torch.ones(32, 1, dtype=torch.float16), None, None, scheme)
    w = [x & 0xFFFFFFFF for x in GPTQFormat().pack(r)["qweight"][:, 0].tolist()]
    assert len(w) == 3
    assert (w[0] >> 30) & 0b11 == 0b10 and w[1] & 1 == 0b1  # row 10 = 0b110
    assert (w[1] >> 31) & 1 == 0b1 and w[2] & 0b11 == 0b01  # row 21 = 0b011
    assert (w[0] >> 27) & 0b111 == 5 and (w[1] >> 1) & 0b111 == 5 and (w[2] >> 2) & 0b111 == 5


def _layout_example():
    """A [N=8, K=16] 4-bit layer: q[n, k] = (k + n) % 16, symmetric, one group of 16."""
    n, k = 8, 16
    q = ((torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16).to(torch.uint8)
    scheme = QuantScheme(bits=4, group_size=-1, symmetric=True)
    return QuantResult(q, torch.ones(n, 1, dtype=torch.float16), None, None, scheme)


def test_gptq_v1_layout_by_hand():
    t = GPTQFormat().pack(_layout_example())
    # qweight [K/8, N]: nibble i of word j = row 8j + i -> column 0: 0x76543210, 0xFEDCBA98
    assert t["qweight"].shape == (2, 8)
    assert t["qweight"][:, 0].tolist() == [u32(0x76543210), u32(0xFEDCBA98)]
    assert t["qweight"][:, 1].tolist() == [u32(0x87654321), u32(0x0FEDCBA9)]
    assert t["qweight"][:, 7].tolist() == [u32(0xEDCBA987), u32(0x6543210F)]
    # symmetric zero 8 stored as 7 in every nibble; g_idx all 0
    assert t["qzeros"].tolist() == [[0x77777777]]
    assert t["g_idx"].tolist() == [0] * 16


def test_awq_layout_by_hand():
    t = AWQFormat().pack(_layout_example())
    # qweight [K, N/8]: nibble i of row k holds column ORDER[i], ORDER = 0,2,4,6,1,3,5,7.
    # row 0: q[n, 0] = n -> nibbles 0,2,4,6,1,3,5,7 -> 0x75316420
    assert t["qweight"].shape == (16, 1)
    assert t["qweight"][0, 0].item() == 0x75316420
    assert t["qweight"][1, 0].item() == u32(0x86427531)  # q[n, 1] = n + 1
    assert t["qweight"][9, 0].item() == u32(0x0ECAFDB9)  # q[n, 9] = (n + 9) % 16
    assert t["qzeros"].tolist() == [[u32(0x88888888)]]  # symmetric zeros stored as 8


def test_compressed_tensors_layout_by_hand():
    t = CompressedTensorsFormat().pack(_layout_example())
    # weight_packed [N, K/8]: value + 8 (= our unsigned code), nibble i = column 8j + i
    assert t["weight_packed"].shape == (8, 2)
    assert t["weight_packed"][0].tolist() == [u32(0x76543210), u32(0xFEDCBA98)]
    assert t["weight_packed"][3].tolist() == [u32(0xA9876543), u32(0x210FEDCB)]
    assert t["weight_shape"].tolist() == [8, 16]
    assert set(t) == {"weight_packed", "weight_scale", "weight_shape"}


def test_compressed_tensors_zero_point_packed_along_n():
    scheme = QuantScheme(bits=4, group_size=-1, symmetric=False)
    r = _layout_example()
    r = QuantResult(r.qweight, r.scales, torch.arange(8, dtype=torch.uint8)[:, None], None, scheme)
    zp = CompressedTensorsFormat().pack(r)["weight_zero_point"]
    assert zp.shape == (1, 1) and zp.item() == 0x76543210


# ---------------------------------------------------------------------------------------
# what the engines compute from our tensors (independent 4-bit dequantizers)


def _nib(words: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return (words.to(torch.int64) >> (4 * i)) & 0xF


def test_gptq_v1_dequant_as_loaders_do():
    # AutoGPTQ / vLLM exllama semantics: w = scales[g_idx[k], n] * (q - (qzeros_nibble + 1))
    gen = torch.Generator().manual_seed(4)
    for sym, order in itertools.product((True, False), ORDERS):
        scheme = make_scheme(4, 32, sym, order)
        r = random_result(scheme, 24, 96, gen, min_zero=1)
        t = GPTQFormat().pack(r)
        k = torch.arange(96)
        q = _nib(t["qweight"][k // 8, :], (k % 8)[:, None])  # [K, N]
        gi = t["g_idx"].long()
        n = torch.arange(24)
        z = _nib(t["qzeros"][gi][:, n // 8], (n % 8)[None, :]) + 1  # [K, N]
        w = t["scales"].float()[gi] * (q - z).float()
        assert torch.equal(w.t(), r.dequantize()), (sym, order)


def test_awq_dequant_as_loaders_do():
    # AutoAWQ's dequantize_gemm: unpack nibbles, undo the order with REVERSE = 0,4,1,5,2,6,3,7
    gen = torch.Generator().manual_seed(5)
    for sym in (True, False):
        scheme = QuantScheme(bits=4, group_size=32, symmetric=sym)
        r = random_result(scheme, 40, 96, gen)
        t = AWQFormat().pack(r)
        reverse = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])

        def unpack(words):  # [R, N/8] -> [R, N]
            nib = _nib(words[:, :, None], torch.arange(8))
            return nib[:, :, reverse].reshape(words.shape[0], -1)

        gi = torch.arange(96) // 32
        w = t["scales"].float()[gi] * (unpack(t["qweight"]) - unpack(t["qzeros"])[gi]).float()
        assert torch.equal(w.t(), r.dequantize()), sym


# ---------------------------------------------------------------------------------------
# cannot_hold


@pytest.mark.parametrize(
    "name,scheme,n,k,needle",
    [
        ("gptq", QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic"), 64, 64, "W8A8"),
        ("awq", QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic"), 64, 64, "W8A8"),
        ("gptq", QuantScheme(bits=4, group_size=128), 64, 320, "group_size"),
        ("awq", QuantScheme(bits=4, group_size=128), 64, 96, "group_size"),
        ("compressed-tensors", QuantScheme(bits=4, group_size=32), 64, 100, "group_size"),
        ("gptq", QuantScheme(bits=3, group_size=-1), 64, 48, "multiple of 32"),
        ("gptq", QuantScheme(bits=2, group_size=32), 24, 96, "out_features"),
        ("gptq", QuantScheme(bits=4, group_size=-1), 64, 20, "multiple of 8"),
        ("awq", QuantScheme(bits=3, group_size=32), 64, 96, "4-bit"),
        ("awq", QuantScheme(bits=4, group_size=32, act_order=True), 64, 96, "act-order"),
        ("awq", QuantScheme(bits=4, group_size=32), 20, 96, "multiple of 8"),
        ("compressed-tensors", QuantScheme(bits=4, group_size=-1), 64, 20, "multiple of 8"),
        ("compressed-tensors", QuantScheme(bits=2, group_size=32, symmetric=False), 24, 96, "out_features"),
    ],
)
def test_cannot_hold(name, scheme, n, k, needle):
    fmt = get_format(name)
    reason = fmt.cannot_hold(scheme, n, k)
    assert reason and needle in reason, reason
    r = random_result(scheme, n, k, torch.Generator().manual_seed(6), min_zero=1)
    with pytest.raises(QuantspecError):
        fmt.pack(r)


def test_can_hold():
    ct = CompressedTensorsFormat()
    assert ct.cannot_hold(QuantScheme(bits=2, group_size=32, symmetric=True), 24, 96) is None
    assert AWQFormat().cannot_hold(QuantScheme(bits=4, group_size=32, act_order=True, static_groups=True), 24, 96) is None
    assert GPTQFormat().cannot_hold(QuantScheme(bits=4, group_size=-1, act_order=True), 40, 160) is None


def test_gptq_v1_refuses_zero_point_0():
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    r = random_result(scheme, 24, 96, torch.Generator().manual_seed(7), min_zero=1)
    r.zeros[3, 1] = 0
    with pytest.raises(QuantspecError, match="zero point of 0"):
        GPTQFormat().pack(r)


def test_permuted_g_idx_needs_act_order():
    scheme = QuantScheme(bits=4, group_size=32)
    r = random_result(make_scheme(4, 32, True, "permuted"), 24, 96, torch.Generator().manual_seed(8))
    r.scheme = scheme
    for fmt in (GPTQFormat(), AWQFormat(), CompressedTensorsFormat()):
        with pytest.raises(ValueError, match="g_idx"):
            fmt.pack(r)


def test_unpack_rejects_wrong_tensors():
    scheme = QuantScheme(bits=4, group_size=32)
    r = random_result(scheme, 24, 96, torch.Generator().manual_seed(9))
    for fmt in (GPTQFormat(), AWQFormat(), CompressedTensorsFormat()):
        t = fmt.pack(r)
        with pytest.raises(QuantspecError):
            fmt.unpack(t, QuantScheme(bits=4, group_size=128), 24, 128)
        t.pop(next(iter(t)))
        with pytest.raises(QuantspecError, match="no tensor"):
            fmt.unpack(t, scheme, 24, 96)
    # a symmetric config over asymmetric zeros is caught, not silently misread
    asym = QuantScheme(bits=4, group_size=32, symmetric=False)
    ra = random_result(asym, 24, 96, torch.Generator().manual_seed(10), min_zero=1)
    for fmt in (GPTQFormat(), AWQFormat()):
        with pytest.raises(QuantspecError, match="zero points"):
            fmt.unpack(fmt.pack(ra), scheme, 24, 96)


# ---------------------------------------------------------------------------------------
# configs: ours round-trip, foreign ones are recognised or refused clearly


def test_get_format():
    assert FORMAT_NAMES == ("gptq", "awq", "compressed-tensors")
    for name in FORMAT_NAMES:
        assert get_format(name).name == name
    with pytest.raises(QuantspecError, match="compressed-tensors"):
        get_format("exl2")


@pytest.mark.parametrize(
    "name,scheme",
    [
        ("gptq", QuantScheme(bits=4, group_size=128)),
        ("gptq", QuantScheme(bits=3, group_size=-1, symmetric=False, act_order=True)),
        ("gptq", QuantScheme(bits=8, group_size=32, act_order=True, static_groups=True)),
        ("awq", QuantScheme(bits=4, group_size=64, symmetric=False)),
        ("compressed-tensors", QuantScheme(bits=4, group_size=128)),
        ("compressed-tensors", QuantScheme(bits=2, group_size=-1, symmetric=False)),
        ("compressed-tensors", QuantScheme(bits=4, group_size=32, act_order=True)),
        ("compressed-tensors", QuantScheme(bits=8, group_size=64, act_order=True, static_groups=True)),
        ("compressed-tensors", QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")),
    ],
)
def test_own_config_round_trip(name, scheme):
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.11.self_attn.o_proj"]
    cfg = get_format(name).quantization_config(scheme, ignore)
    fmt, parsed = read_quantization_config(cfg)
    assert fmt.name == name and parsed.format == name
    assert parsed.scheme == scheme
    assert sorted(parsed.ignore) == sorted(ignore)


def test_gptq_config_fields():
    cfg = GPTQFormat().quantization_config(QuantScheme(bits=4, group_size=128), ["lm_head", "model.layers.1.mlp.up_proj"])
    assert cfg["quant_method"] == "gptq" and cfg["checkpoint_format"] == "gptq"
    assert cfg["bits"] == 4 and cfg["group_size"] == 128 and cfg["sym"] is True and cfg["desc_act"] is False
    assert cfg["lm_head"] is False
    assert cfg["dynamic"] == {r"-:^model\.layers\.1\.mlp\.up_proj$": {}}
    import re

    (pattern,) = cfg["dynamic"]
    assert re.match(pattern[2:], "model.layers.1.mlp.up_proj")
    assert not re.match(pattern[2:], "model.layers.11.mlp.up_proj")


def test_gptq_static_groups_override_is_written_desc_act_false_and_reads_back():
    """A regrouped layer of an act-order + static-groups recipe keeps the natural layout: its
    dynamic rule says desc_act=false (vLLM 0.32 refuses desc_act=true in a rule too: it refused
    our GPTQ-default SmolLM2 export as a speculative draft) and reads back as the same scheme."""
    from quantspec.formats.overrides import split_overrides, with_overrides

    base = QuantScheme(bits=4, group_size=128, act_order=True, static_groups=True)
    regrouped = QuantScheme(bits=4, group_size=64, act_order=True, static_groups=True)
    cfg = with_overrides("gptq", GPTQFormat().quantization_config(base, []), [(["model.layers.0.mlp.up_proj"], regrouped)])
    (rule,) = [v for k, v in cfg["dynamic"].items() if k.startswith("+:")]
    assert cfg["desc_act"] is False and rule["desc_act"] is False
    _, overrides = split_overrides(cfg)
    assert overrides[0][1] == regrouped


def test_awq_symmetric_config_reads_back_as_zero_point():
    scheme = QuantScheme(bits=4, group_size=128, symmetric=True)
    cfg = AWQFormat().quantization_config(scheme, [])
    assert cfg == {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None,
    }
    fmt, parsed = read_quantization_config(cfg)
    assert parsed.scheme == QuantScheme(bits=4, group_size=128, symmetric=False)
    # the symmetric layer reads back with zeros of 8: same weights
    r = random_result(scheme, 24, 128, torch.Generator().manual_seed(11))
    back = fmt.unpack(fmt.pack(r), parsed.scheme, 24, 128)
    assert torch.equal(back.zeros, torch.full((24, 1), 8, dtype=torch.uint8))
    assert torch.equal(back.dequantize(), r.dequantize())


def test_foreign_configs():
    autogptq = {
        "bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
        "sym": True, "true_sequential": True, "model_name_or_path": None,
        "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": "gptq",
    }
    fmt, parsed = read_quantization_config(autogptq)
    assert isinstance(fmt, GPTQFormat) and fmt.zero_offset == 1
    assert parsed.scheme == QuantScheme(bits=4, group_size=128, act_order=True)
    assert parsed.ignore == ["lm_head"]

    fmt, parsed = read_quantization_config({**autogptq, "checkpoint_format": "gptq_v2", "sym": False})
    assert isinstance(fmt, GPTQFormat) and fmt.checkpoint_format == "gptq_v2" and fmt.zero_offset == 0
    # QuantLinear rebuilds the reader with get_format(fmt.name): it must be the v2 one
    again = get_format(fmt.name)
    assert isinstance(again, GPTQFormat) and again.zero_offset == 0

    autoawq = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4,
               "version": "gemm", "modules_to_not_convert": ["visual"]}
    fmt, parsed = read_quantization_config(autoawq)
    assert isinstance(fmt, AWQFormat) and parsed.ignore == ["visual"]

    llmc = {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128,
                        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                        "symmetric": True, "type": "int"}}},
        "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": "0.12.2",
    }
    fmt, parsed = read_quantization_config(llmc)
    assert isinstance(fmt, CompressedTensorsFormat)
    assert parsed.scheme == QuantScheme(bits=4, group_size=128) and parsed.ignore == ["lm_head"]


def _ct(**over):
    cfg = CompressedTensorsFormat().quantization_config(QuantScheme(bits=4, group_size=128), ["lm_head"])
    cfg.update(over)
    return cfg


@pytest.mark.parametrize(
    "cfg,needle",
    [
        ({}, "no quantization_config"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "marlin"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {r"+:.*down": {"bits": 8}}}, "mixed"),
        ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "bits=5"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv_fast"}, "gemv_fast"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}, "zero_point"),
        (_ct(quantization_status="frozen"), "frozen"),
        (_ct(format="float-quantized", config_groups={"group_0": {"targets": ["Linear"], "format": "float-quantized",
          "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}}), "float weights"),
        (_ct(format="pack-quantized", config_groups={"group_0": {"targets": ["Linear"], "format": "pack-quantized",
          "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}), "does not hold mxfp4"),
        (_ct(config_groups={"a": {"targets": ["Linear"]}, "b": {"targets": ["Linear"]}}), "config_groups"),
        (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True}), "kv_cache_scheme"),
        (_ct(config_groups={"group_0": {"targets": ["Linear"], "format": "pack-quantized",
          "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
          "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}), "input_activations"),
    ],
)
def test_bad_configs(cfg, needle):
    with pytest.raises(QuantspecError, match=needle):
        read_quantization_config(cfg)


# ---------------------------------------------------------------------------------------
# cross-check against compressed-tensors itself (optional dependency)


def _ct_compress(result: QuantResult, cfg: dict) -> dict[str, torch.Tensor]:
    """Quantize-and-compress ``result.dequantize()`` with compressed-tensors' own
    ModelCompressor, with our scales and zeros as its qparams."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    n, k = result.shape
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    apply_quantization_config(model, QuantizationConfig.model_validate(cfg))
    lin = model[0]
    with torch.no_grad():
        lin.weight.copy_(result.dequantize())
        lin.weight_scale.copy_(result.scales.float())
        if result.zeros is not None:
            lin.weight_zero_point.copy_((result.zeros.to(torch.int16) - result.scheme.sym_zero).to(torch.int8))
        if result.g_idx is not None:
            lin.weight_g_idx.copy_(result.g_idx)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    return {name.split(".", 1)[1]: t for name, t in model.state_dict().items()}


@pytest.mark.parametrize("bits,group,sym", [(4, 128, True), (4, 32, False), (8, -1, True), (2, 32, False), (3, 32, True), (8, 128, False)])
def test_cross_check_compressed_tensors(bits, group, sym):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    fmt = CompressedTensorsFormat()
    scheme = QuantScheme(bits=bits, group_size=group, symmetric=sym)
    r = random_result(scheme, 64, 256, torch.Generator().manual_seed(bits + group))
    ours = fmt.pack(r)
    signed = (r.qweight.to(torch.int16) - scheme.sym_zero).to(torch.int8)
    assert torch.equal(ours["weight_packed"], pack_to_int32(signed, bits))
    theirs = _ct_compress(r, fmt.quantization_config(scheme, []))
    assert set(theirs) == set(ours)
    for name in ("weight_packed", "weight_shape") + (() if sym else ("weight_zero_point",)):
        assert torch.equal(theirs[name], ours[name]), name
    assert torch.equal(theirs["weight_scale"], ours["weight_scale"].float())


def test_cross_check_compressed_tensors_w8a8():
    pytest.importorskip("compressed_tensors")
    fmt = CompressedTensorsFormat()
    scheme = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
    r = random_result(scheme, 40, 96, torch.Generator().manual_seed(12))
    theirs = _ct_compress(r, fmt.quantization_config(scheme, []))
    ours = fmt.pack(r)
    assert set(theirs) == set(ours)
    assert torch.equal(theirs["weight"], ours["weight"])


def test_compressed_tensors_and_transformers_read_our_config():
    pytest.importorskip("compressed_tensors")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    for scheme in (
        QuantScheme(bits=4, group_size=128, symmetric=False, act_order=True, static_groups=True),
        QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic"),
    ):
        cfg = CompressedTensorsFormat().quantization_config(scheme, ["lm_head"])
        qc = CompressedTensorsConfig.from_dict(cfg).quantization_config
        (group,) = qc.config_groups.values()
        assert group.weights.num_bits == scheme.bits and group.weights.symmetric == scheme.symmetric
        assert qc.ignore == ["lm_head"] and qc.format == cfg["format"]
