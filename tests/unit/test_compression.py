"""Compressors as pure functions: W ranks simulated in one process, the collective replaced by
its definition (sum for all_reduce, stack for all_gather)."""

from __future__ import annotations

from math import prod

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.compression import COMPRESSORS, build_compressor
from scaletrain.compression.base import Compressor, Residuals, nbytes
from scaletrain.compression.powersgd import compressible
from scaletrain.compression.sign import pack_signs, unpack_signs
from scaletrain.compression.spec import SPECS, parse_compression
from scaletrain.compression.topk import top_indices

SHAPES = [torch.Size([16, 3, 3, 3]), torch.Size([16]), torch.Size([10, 64]), torch.Size([10])]
NUMEL = sum(prod(s) for s in SHAPES)


def exchange(compressors: list[Compressor], grads: list[torch.Tensor], key="bucket"):
    """One bucket through every rank's compressor and the collective; (result, payload bytes
    per rank over all rounds)."""
    first = compressors[0]
    payloads = [c.compress(key, g, SHAPES) for c, g in zip(compressors, grads, strict=True)]
    sent = nbytes(payloads[0])

    def collective(ps):
        return sum(ps) if first.collective == "all_reduce" else torch.stack(ps)

    for _ in range(first.rounds - 1):
        reduced = collective(payloads)
        payloads = [c.next_round(key, reduced) for c in compressors]
        sent += nbytes(payloads[0])
    reduced = collective(payloads)
    outs = []
    for c in compressors:
        out = torch.empty(NUMEL)
        c.decompress(key, reduced, out)
        outs.append(out)
    for out in outs[1:]:  # bit for bit (NaN where the other has NaN: an overflowed step)
        same = torch.allclose(out, outs[0], rtol=0, atol=0, equal_nan=True)
        assert same, "ranks decoded different gradients"
    return outs[0], sent


def ranks(spec: str, world: int) -> list[Compressor]:
    compressors = [build_compressor(spec, world) for _ in range(world)]
    assert all(c is not None for c in compressors)
    return compressors  # type: ignore[return-value]


def test_every_spec_has_a_compressor():
    assert set(SPECS) == set(COMPRESSORS) | {"none"}
    assert build_compressor("none", 2) is None


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ("none", {})),
        ("fp16", ("fp16", {})),
        ("topk", ("topk", {"ratio": 0.01})),
        ("topk:ratio=0.5", ("topk", {"ratio": 0.5})),
        ("topk:ratio=1", ("topk", {"ratio": 1.0})),
        ("powersgd:rank=2", ("powersgd", {"rank": 2, "warm_start": True})),
        ("powersgd:warm_start=false:rank=8", ("powersgd", {"rank": 8, "warm_start": False})),
    ],
)
def test_parse_compression(spec, expected):
    assert parse_compression(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zip", "unknown compressor 'zip'; valid: none, fp16, bf16, topk"),
        ("powersgd:rank=0", "powersgd rank must be an integer >= 1, got '0'"),
        ("powersgd:rank=-3", "must be an integer >= 1"),
        ("powersgd:rank=two", "must be an integer >= 1"),
        ("topk:ratio=0", r"topk ratio must be a fraction in \(0, 1\]"),
        ("topk:ratio=1.5", r"topk ratio must be a fraction in \(0, 1\]"),
        ("topk:k=5", "topk has no option 'k=5'; its options: ratio"),
        ("fp16:rank=2", "fp16 has no option 'rank=2'; its options: none"),
        ("powersgd:rank", "has no option 'rank'"),
    ],
)
def test_bad_compression_specs_say_what_is_valid(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_compression(spec)


def random_grads(world: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(world)]


@pytest.mark.parametrize(("spec", "tol"), [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_is_the_mean_within_its_precision(spec, tol):
    grads = random_grads(3)
    out, sent = exchange(ranks(spec, 3), grads)
    assert torch.allclose(out, sum(grads) / 3, atol=tol)
    assert sent == NUMEL * 2


def test_topk_with_ratio_one_is_exact():
    grads = random_grads(3)
    out, _ = exchange(ranks("topk:ratio=1", 3), grads)
    assert torch.allclose(out, sum(grads) / 3, atol=1e-6)


def test_topk_sends_the_largest_entries():
    grad = torch.zeros(NUMEL)
    grad[[5, 77, 300]] = torch.tensor([3.0, -4.0, 2.5])
    grad[400] = 0.1
    out, sent = exchange(ranks("topk:ratio=0.01", 1), [grad])
    k = int(NUMEL * 0.01)
    assert sent == 8 * k
    assert out[[5, 77, 300]].tolist() == [3.0, -4.0, 2.5]


def test_powersgd_is_exact_on_low_rank_gradients_and_plain_vectors():
    """Every rank's matrix gradients are multiples of one rank-1 matrix: their mean has rank 1,
    which rank-2 PowerSGD recovers exactly; vectors travel uncompressed."""
    g = torch.Generator().manual_seed(1)
    grads = []
    for r in range(3):
        pieces = []
        for shape in SHAPES:
            if compressible(shape, 2):
                n, m = shape[0], prod(shape[1:])
                u = torch.arange(1.0, n + 1) / n
                v = torch.cos(torch.arange(float(m)))
                pieces.append((r + 1) * torch.outer(u, v).reshape(-1))
            else:
                pieces.append(torch.randn(prod(shape), generator=g))
        grads.append(torch.cat(pieces))
    out, sent = exchange(ranks("powersgd:rank=2", 3), grads)
    assert torch.allclose(out, sum(grads) / 3, atol=1e-5)
    assert sent < NUMEL * 4 / 3


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "powersgd:rank=1", "sign"])
def test_error_feedback_loses_nothing(spec):
    """sum over steps and ranks of the gradients == W * sum of what was applied + what the
    ranks still hold back: compression delays, it never drops."""
    world, steps = 3, 6
    compressors = ranks(spec, world)
    total_in = torch.zeros(NUMEL, dtype=torch.float64)
    total_out = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(steps):
        grads = random_grads(world, seed=step)
        out, _ = exchange(compressors, grads)
        total_in += sum(grads).double()
        total_out += out.double() * world
    held = sum(c.residuals.held("bucket") for c in compressors)  # type: ignore[attr-defined]
    assert torch.allclose(total_in, total_out + held.double(), atol=1e-4)
    assert held.abs().max() > 0  # it did compress


def test_powersgd_warm_start_improves_over_steps():
    """With the same gradient every step, warm-started power iteration converges towards the
    best rank-r approximation; without warm start each step starts from a fresh random Q."""
    grad = random_grads(1, seed=7)[0]

    def errors(spec):
        comp = ranks(spec, 1)
        out = []
        for _ in range(5):
            comp[0].residuals = Residuals()  # type: ignore[attr-defined]  # isolate the factors
            result, _ = exchange(comp, [grad])
            out.append((result - grad).norm().item())
        return out

    warm, cold = errors("powersgd:rank=2"), errors("powersgd:rank=2:warm_start=false")
    assert warm[-1] < warm[0] and warm[-1] < min(cold)


@pytest.mark.parametrize(
    "spec", ["fp16", "bf16", "topk", "topk:ratio=0.3", "powersgd:rank=1", "powersgd", "sign"]
)
def test_ratio_matches_the_payload(spec):
    comp = ranks(spec, 2)
    _, sent = exchange(comp, random_grads(2))
    assert comp[0].ratio(SHAPES) == pytest.approx(NUMEL * 4 / sent)


def test_residuals_are_kept_per_bucket():
    comp = ranks("topk:ratio=0.01", 1)
    a, b = random_grads(2)
    exchange(comp, [a], key="a")
    exchange(comp, [b], key="b")
    held_a = comp[0].residuals.held("a")  # type: ignore[attr-defined]
    held_b = comp[0].residuals.held("b")  # type: ignore[attr-defined]
    assert held_a is not None and held_b is not None and not torch.equal(held_a, held_b)
    # The residual of a bucket with another layout (DDP's rebuild) is not applied.
    assert torch.equal(comp[0].residuals.add_to("a", torch.zeros(3)), torch.zeros(3))  # type: ignore[attr-defined]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=70))
def test_sign_packing_round_trips(values):
    t = torch.tensor(values, dtype=torch.float32)
    packed = pack_signs(t)
    assert packed.numel() == -(-len(values) // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_signs(packed, len(values)), torch.where(t >= 0, 1.0, -1.0))


@pytest.mark.parametrize("kind", ["normal", "heavy_tail", "ties"])
def test_fast_top_indices_equal_torch_topk(kind):
    g = torch.Generator().manual_seed(3)
    n, k = 300_000, 3_000
    if kind == "normal":
        values = torch.randn(n, generator=g).abs()
    elif kind == "heavy_tail":  # the sample misses the few huge entries: fallback path
        values = torch.rand(n, generator=g)
        values[torch.randperm(n, generator=g)[:50]] = 1e6
    else:
        values = torch.randint(0, 3, (n,), generator=g).float()
    expected = set(values.topk(k).indices.tolist())
    got = top_indices(values, k)
    assert got.numel() == k
    if kind == "ties":  # ties may be broken differently; the kept values must be the same
        assert sorted(values[got].tolist()) == sorted(values.topk(k).values.tolist())
    else:
        assert set(got.tolist()) == expected


@pytest.mark.parametrize("spec", sorted(set(SPECS) - {"none"}))
def test_every_compressor_decodes_for_one_rank(spec):
    """One rank (a one-worker run with --compression): its payload is a single row, whose
    slices are contiguous at any offset; sign's float scales sat at byte 138 of this bucket
    and a float32 view of them failed."""
    assert (-(-NUMEL // 8)) % 4, "the bucket must leave the scales unaligned"
    grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    out, _ = exchange(ranks(spec, 1), [grad])
    assert torch.isfinite(out).all() and out.abs().sum() > 0


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "sign"])
def test_an_overflowed_step_leaves_no_poison_in_the_compressors_memory(spec):
    """An fp16 overflow (inf in one rank's scaled gradient) decodes to a non-finite step on
    every rank, which the loss scaler skips; the compressor then forgets that bucket (as the
    hook has it do), and the next step decodes finite. Kept, the inf in the error feedback
    (and PowerSGD's warm-started Q) made every later step overflow: the scale collapsed.
    (topk sends the inf itself, the largest entry, and keeps none of it.)"""
    from scaletrain.compression.hook import forget_if_not_finite

    comp = ranks(spec, 2)
    g = torch.Generator().manual_seed(2)
    bad = torch.randn(NUMEL, generator=g)
    bad[7] = float("inf")
    out, _ = exchange(comp, [bad, torch.randn(NUMEL, generator=g)])
    assert not torch.isfinite(out).all()
    for c in comp:
        forget_if_not_finite(c, "bucket", out)
    out, _ = exchange(comp, [torch.randn(NUMEL, generator=g) for _ in comp])
    assert torch.isfinite(out).all()
