"""``benchmarks/train_step.py``'s command line: ``--scenarios`` takes any batch of either layout
(the hybrid's unpatched step fits the H100 at batch 1 only) and refuses anything else; each
surgery contender patches with its own options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_step


def test_scenarios_take_any_batch_of_either_layout():
    assert train_step.parse_scenarios("padded1,packed1,padded8") == [
        ("padded", 1),
        ("packed", 1),
        ("padded", 8),
    ]


def test_quick_drops_batch_4_from_the_defaults_only():
    asked = train_step.parse_scenarios("padded4,packed2")
    assert train_step.scenarios_to_run(asked, quick=True) == [("padded", 4), ("packed", 2)]
    assert ("padded", 4) not in train_step.scenarios_to_run(None, quick=True)
    assert train_step.scenarios_to_run(None, quick=False) == train_step.SCENARIOS


def test_every_input_structure_is_a_scenario():
    """Issue 33's input structures: each kind parses, and each batch holds what its name says
    (a tiny one, on CPU)."""
    assert train_step.parse_scenarios("plain2,ones1,prompts2,leftpadded4,packedcu2") == [
        ("plain", 2), ("ones", 1), ("prompts", 2), ("leftpadded", 4), ("packedcu", 2),
    ]  # fmt: skip
    cpu = torch.device("cpu")
    batches = {kind: train_step.make_batch(kind, 4, 32, 101, cpu, 0) for kind in train_step.KINDS}
    assert set(batches["plain"][0]) == {"input_ids", "labels"} and batches["plain"][1] == 128
    assert (batches["plain"][0]["labels"] != -100).all()
    ones = batches["ones"][0]
    assert ones["attention_mask"].all() and torch.equal(ones["labels"], ones["input_ids"])
    assert (batches["prompts"][0]["labels"][:, :8] == -100).all()
    assert (batches["prompts"][0]["labels"][:, 8:] != -100).all()
    left, right = batches["leftpadded"][0]["attention_mask"], batches["padded"][0]["attention_mask"]
    assert torch.equal(left, right.flip(1)) and batches["leftpadded"][1] == int(right.sum())
    packed, cu = batches["packed"][0], batches["packedcu"][0]
    assert torch.equal(packed["position_ids"], cu["position_ids"])
    starts = (cu["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    assert (
        cu["cu_seq_lens_q"].tolist() == [*starts, 128]
        and cu["cu_seq_lens_q"] is cu["cu_seq_lens_k"]
    )
    assert cu["max_length_q"] == max(torch.tensor([*starts, 128]).diff().tolist())


@pytest.mark.parametrize("text", ["padded", "packed0", "varlen2", "padded2,", "padded-1"])
def test_scenarios_refuse_what_is_not_a_layout_and_a_batch(text):
    with pytest.raises(argparse.ArgumentTypeError):
        train_step.parse_scenarios(text)


@pytest.mark.parametrize(
    ("contender", "options"),
    [
        ("surgery", {}),
        ("surgery_masked", {"causal_right_padding": False}),
        ("surgery_every_token", {"loss_skip_ignored": False}),
        ("surgery_inductor_norm", {"rms_norm": False}),
        ("surgery_inductor_mlp", {"gated_mlp": False}),
        ("surgery_no_recompute", {"recompute_mlp_product": False, "recompute_norm_output": False}),
    ],
)
def test_surgery_contenders_patch_with_their_options(contender, options):
    import surgery

    model = train_step.build_model("llama", True, torch.device("cpu"), dtype=torch.float32)
    train_step.apply_contender(model, contender)
    assert surgery.patch_options(model) == surgery.PatchOptions(**options)


def test_kernel_time_by_class_sums_each_class_and_the_idle_gaps():
    """The profile's kernel table: each kernel in the first class its name matches, the rest by
    name, the busy time the union of overlapping kernels, idle what the span leaves."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
            is_user_annotation=annotation,
        )  # fmt: skip

    prof = SimpleNamespace(
        events=lambda: [
            event("aten::mm", 0, 5000, DeviceType.CPU),  # host event: not a kernel
            event("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 0, 4000),
            event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 1000, 2000),  # another stream
            event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3000, 5000),  # overlaps
            event("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", 5000, 5500),
            event("rms_norm_fwd_kernel", 6000, 7000),  # after 0.5 ms idle
            event("void at::native::vectorized_elementwise_kernel<8>", 7000, 7500),
            # a range code marked on the GPU's timeline (FSDP's), over the idle gap: not a kernel
            event("FSDP::all_gather (model.layers.4)", 4000, 8000, annotation=True),
        ]
    )
    table = train_step.kernel_time_by_class(prof)
    assert table.splitlines()[0] == "GPU span 7.50 ms, busy 7.00 ms, idle 0.50 ms (6.7%)"
    assert "matrix products while a collective ran: 1.00 ms of 4.00 (25.0%)" in table
    assert "FSDP::" not in table
    rows = {line[:40].strip(): line[40:].split() for line in table.splitlines()[2:8]}
    assert rows["matrix products"] == ["4.00", "53.3"]
    assert rows["collectives (NCCL)"] == ["1.00", "13.3"]
    assert rows["attention"] == ["2.50", "33.3"]
    assert rows["other (Triton kernels and the rest)"] == ["1.00", "13.3"]
    assert rows["PyTorch elementwise and reductions"] == ["0.50", "6.7"]
    assert "rms_norm_fwd_kernel" in table.split("by kernel name:")[1]


def test_kernel_time_span_ends_at_the_latest_end_when_kernels_overlap():
    """Two streams: a long kernel that starts first holds a short one that starts later; the
    span runs to the long one's end, and nothing is idle."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    prof = SimpleNamespace(
        events=lambda: [event("nvjet_a", 0, 10000), event("ncclKernel_AllReduce", 2000, 3000)]
    )
    first = train_step.kernel_time_by_class(prof).splitlines()[0]
    assert first == "GPU span 10.00 ms, busy 10.00 ms, idle 0.00 ms (0.0%)"


def test_products_beside_collectives_count_each_overlap_once():
    """The products' time while a collective ran: overlapping collectives (two streams) count
    once, a product spanning two of them counts both parts, one beside none counts nothing."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    prof = SimpleNamespace(
        events=lambda: [
            event("nvjet_a", 0, 10000),
            event("ncclKernel_AllGather", 1000, 3000),
            event("ncclKernel_ReduceScatter", 2000, 4000),  # overlaps the all-gather
            event("ncclKernel_AllReduce", 6000, 7000),
            event("nvjet_b", 12000, 13000),  # beside no collective
        ]
    )
    table = train_step.kernel_time_by_class(prof)
    assert "matrix products while a collective ran: 4.00 ms of 11.00 (36.4%)" in table


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_counts_refuse_what_is_not_a_whole_number_of_at_least_one(text):
    with pytest.raises(argparse.ArgumentTypeError):
        train_step.positive_int(text)
    assert train_step.positive_int("8") == 8


def _calls(*rows):
    """A profile whose events are the product calls ``(name, shapes, calls, device us of each)``."""
    from types import SimpleNamespace

    events = [
        SimpleNamespace(name=name, input_shapes=shapes, device_time_total=us, cpu_parent=None)
        for name, shapes, calls, us in rows
        for _ in range(calls)
    ]
    return SimpleNamespace(events=lambda: events)


def test_products_by_shape_rates_each_product_from_its_operands():
    """The profile's product table: 2 M N K flops per call from the operands' shapes (addmm's
    after its bias, bmm's times its batch), the slowest shape first; ops that are not products
    are left out."""
    prof = _calls(
        ("aten::mm", [[4096, 2048], [2048, 8192]], 2, 250.0),  # 2 x 137.4 GFLOP in 0.5 ms
        ("aten::addmm", [[8192], [4096, 2048], [2048, 8192], [], []], 1, 500.0),
        ("aten::addmm_", [[4096, 2048], [4096, 2048], [2048, 2048], [], []], 1, 1000.0),
        ("aten::bmm", [[4, 1024, 64], [4, 64, 1024]], 1, 10.0),
        ("aten::add", [[4096, 2048], [4096, 2048]], 1, 100.0),
    )
    lines = train_step.products_by_shape(prof).splitlines()
    assert lines[0] == "4 shapes, 2.01 ms, 0.45 TFLOP at 222 TFLOP/s; 0 calls launched no kernel"
    assert lines[2].split()[0] == "addmm_" and lines[2].split()[-4:] == ["1", "1.00", "34", "0"]
    assert lines[3].split()[0] == "mm" and lines[3].split()[-4:] == ["2", "0.50", "550", "0"]
    assert lines[4].split()[0] == "addmm" and lines[4].split()[-4:] == ["1", "0.50", "275", "0"]
    assert lines[5].split()[0] == "bmm" and lines[5].split()[-2] == "54"


def test_a_product_that_launched_no_kernel_is_counted_apart():
    """A call entered but never run (a checkpoint's recomputation stopping inside it) adds no
    flops to its shape's rate: three calls of 1 ms and one without a kernel rate as three."""
    prof = _calls(
        ("aten::mm", [[8192, 14336], [14336, 4096]], 3, 1000.0),
        ("aten::mm", [[8192, 14336], [14336, 4096]], 1, 0.0),
        ("aten::mm", [[8, 8], [8, 8]], 1, 0.0),  # no kernel for any call: no row
    )
    lines = train_step.products_by_shape(prof).splitlines()
    assert lines[0] == "1 shapes, 3.00 ms, 2.89 TFLOP at 962 TFLOP/s; 2 calls launched no kernel"
    assert lines[2].split()[-4:] == ["3", "3.00", "962", "1"]


def test_a_grouped_product_counts_each_token_against_one_expert():
    """``_grouped_mm`` of (tokens, K) by (experts, K, N): 2 tokens K N flops, not times the
    experts."""
    prof = _calls(("aten::_grouped_mm", [[4096, 2048], [8, 2048, 768], [8]], 1, 100.0))
    lines = train_step.products_by_shape(prof).splitlines()
    assert lines[0] == "1 shapes, 0.10 ms, 0.01 TFLOP at 129 TFLOP/s; 0 calls launched no kernel"


def test_products_inside_a_product_are_not_counted_again():
    """A grouped GEMM that falls back to one ``mm`` per group (fp32, or a GPU without the grouped
    kernel) is one call of its own shape; the nested calls, whose time it already holds, are
    left out."""
    from types import SimpleNamespace

    prof = _calls(("aten::_grouped_mm", [[4096, 2048], [8, 2048, 768], [8]], 1, 100.0))
    grouped = prof.events()[0]
    nested = _calls(("aten::mm", [[512, 2048], [2048, 768]], 8, 12.5)).events()
    for ev in nested:
        ev.cpu_parent = grouped
    prof = SimpleNamespace(events=lambda: [grouped, *nested])
    lines = train_step.products_by_shape(prof).splitlines()
    assert lines[0] == "1 shapes, 0.10 ms, 0.01 TFLOP at 129 TFLOP/s; 0 calls launched no kernel"
